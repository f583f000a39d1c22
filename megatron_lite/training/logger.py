"""Megatron's log lines, printed by the last rank (it is on the last pipeline stage, which has the loss)."""
from __future__ import annotations

import math

import torch.distributed as dist

from megatron_lite.config import Config, TrainingConfig
from megatron_lite.model import flops
from megatron_lite.model.moe.router import BALANCING_LOSS_NAMES
from megatron_lite.model.moe.routing_statistics import RoutingSummary
from megatron_lite.optimizer.optimizer_param_scheduler import lr_decay_samples
from megatron_lite.process_groups.parallel_state import ParallelState
from megatron_lite.training import metrics
from megatron_lite.training.run_plan import RunPlan
from megatron_lite.checkpointing.training_state import TrainingState


def is_last_rank() -> bool:
    """Megatron prints from the last rank: it is on the last pipeline stage, which has the loss."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


def format_startup_summary(config: Config, parallel_state: ParallelState, plan: RunPlan) -> str:
    """What this run is, in a few lines: model size, layout, batch, checkpoints."""
    parallel, training, checkpoint = config.parallel, config.training, config.checkpoint
    dp = parallel_state.data_parallel_world_size
    global_batch = training.global_batch(dp)
    total_parameters, trainable_parameters = plan.parameters.total, plan.parameters.trainable
    stages = ", ".join(_count(n) for n in plan.parameters.per_stage)
    saves = (f"to {checkpoint.save} every {checkpoint.save_interval} iterations and at the end"
             if checkpoint.save_interval else f"to {checkpoint.save} at the end") if checkpoint.save else "not saved"
    trainable = "" if config.peft.peft is None else (
        f", {_count(trainable_parameters)} of them trainable ({100 * trainable_parameters / total_parameters:.2f}%, "
        f"--peft {config.peft.peft}; the base is frozen)")
    lines = [
        f" model: {_count(total_parameters)} parameters{trainable} ({config.model.num_layers} layers, hidden "
        f"{config.model.hidden_size}); per pipeline stage: {stages}",
        f" layout: {parallel_state.world_size} processes = tensor {parallel.tensor_model_parallel_size} x pipeline "
        f"{parallel.pipeline_model_parallel_size} x data {dp}"
        + (f" x context {parallel.context_parallel_size} (each sequence split over {parallel.context_parallel_size} "
           f"ranks, --cp-comm-type {' '.join(sorted(set(parallel.cp_comm_type)))})"
           if parallel.context_parallel_size > 1 else "")
        + (f", {parallel.virtual_pipeline_model_parallel_size} virtual stages"
           if parallel.virtual_pipeline_model_parallel_size else ""),
        f" batch: {global_batch} sequences = micro-batch {training.micro_batch_size} x "
        f"{training.num_microbatches(dp)} micro-batches x data {dp}; "
        f"{global_batch * config.model.seq_length} tokens per iteration{_batch_growth(training)}, "
        f"{plan.train_iters} iterations" + (f" ({plan.length})" if plan.length else ""),
        f" checkpoints: {saves}" + (f"; loading {checkpoint.load}" if checkpoint.load else ""),
    ]
    if _decays_before_the_end(config, global_batch, plan):
        lines.append(_decay_end_note(config, global_batch, plan))
    return "\n".join(lines)


def _first_iteration_at_min_lr(config: Config, global_batch: int, plan: RunPlan) -> int:
    """The iteration from which the LR stays at --min-lr: the scheduler reaches its decay's end after the
    iterations before it (the LR of iteration i is set by the samples of iterations 1 .. i - 1)."""
    return plan.calculator.iterations_to_reach(lr_decay_samples(config, global_batch)) + 1


def _decays_before_the_end(config: Config, global_batch: int, plan: RunPlan) -> bool:
    """Whether the LR schedule ends before training does (a DeepSpeed scheduler's total_num_steps below the
    run's length, say), so that the last iterations run at --min-lr. A constant LR has no end; a resumed run
    that takes its checkpoint's schedule is not this command line's to judge."""
    if config.optimizer.lr_decay_style == "constant" or config.optimizer.use_checkpoint_opt_param_scheduler:
        return False
    return _first_iteration_at_min_lr(config, global_batch, plan) <= plan.train_iters


def _decay_end_note(config: Config, global_batch: int, plan: RunPlan) -> str:
    optimizer, first = config.optimizer, _first_iteration_at_min_lr(config, global_batch, plan)
    flag = (f"--lr-decay-samples {optimizer.lr_decay_samples}" if config.training.train_samples is not None
            else f"--lr-decay-iters {optimizer.lr_decay_iters}, or a DeepSpeed scheduler's total_num_steps")
    still = ": those iterations change no weight" if optimizer.min_lr == 0 else ""
    iterations = f"iteration {first}" if first == plan.train_iters else f"iterations {first}-{plan.train_iters}"
    return (f" note: the learning rate's decay ends before training does ({flag}): {iterations} of "
            f"{plan.train_iters} train at the learning rate --min-lr {optimizer.min_lr:g}{still}. To decay over the "
            f"whole run, drop the decay length (it defaults to the run's) or shorten the run.")


def _batch_growth(training: TrainingConfig) -> str:
    """How the global batch grows to its final size, if it does."""
    if training.step_batch_size_schedule is not None:
        return f' (stepped up by --step-batch-size-schedule "{training.step_batch_size_schedule}", in tokens)'
    if training.rampup_batch_size is not None:
        return " (ramped up from {} by {} over {} samples)".format(*training.rampup_batch_size)
    return ""


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


class TrainingLogger:
    """Megatron's log line every --log-interval iterations, from the last rank (which has the loss),
    plus throughput, MFU and TensorBoard scalars.

    The global batch may change between iterations (--rampup-batch-size, --step-batch-size-schedule): each
    iteration's FLOPs and tokens are counted with its own batch, and the line shows the latest batch, as Megatron's."""

    def __init__(self, config: Config, parallel_state: ParallelState, train_iters: int, tokens_in=None):
        """``tokens_in(n)``: the tokens the first n samples feed through the model (an --sft sample's padding is
        not counted); default n x --seq-length, every position of a pretraining sample being a token."""
        self.config = config
        self.train_iters = train_iters
        self.tokens_in = tokens_in or (lambda samples: samples * config.model.seq_length)
        self.world_size = parallel_state.world_size
        self.padded_vocab_size = config.model.padded_vocab_size(parallel_state.tensor_model_parallel_world_size)
        self.peak_tflops = metrics.device_peak_tflops(config.logging.peak_tflops)
        # The scalars of the log lines, to TensorBoard and W&B, from the rank that prints them.
        self.writer = metrics.tensorboard_writer(config.logging.tensorboard_dir) if is_last_rank() else None
        self.wandb = metrics.wandb_run(config.logging, config.checkpoint.save, config.to_dict()) \
            if is_last_rank() else None
        self.global_batch = None
        self.loss_name = metrics.loss_name(config.data)
        self._reset()

    def _reset(self) -> None:
        self.losses, self.seconds, self.skipped, self.nan, self.flops, self.tokens = [], 0.0, 0, 0, 0.0, 0
        self.routing, self.statistics = [], []

    def record(self, loss: float | None, seconds: float, skipped: bool, global_batch: int,
               routing: RoutingSummary | None = None, statistics: dict | None = None, *,
               consumed_samples: int | None = None) -> None:
        """As Megatron: the interval's loss averages the iterations that updated the weights. ``routing``: the
        iteration's mixture-of-experts statistics (``routing_statistics.routing_summary``), if it has experts;
        ``statistics``: every logged mean of the iteration, the loss first (``loop.average_losses``).
        ``consumed_samples``: the run's samples after this iteration (default: this iteration's alone), whose
        last ``global_batch`` the throughput counts the tokens of."""
        if statistics is not None and len(statistics) > 1 and not skipped:
            self.statistics.append(dict(list(statistics.items())[1:]))
        self.seconds += seconds
        if routing is not None:
            self.routing.append(routing)
        self.skipped += int(skipped)
        self.global_batch = global_batch
        consumed = global_batch if consumed_samples is None else consumed_samples
        self.tokens += self.tokens_in(consumed) - self.tokens_in(consumed - global_batch)
        self.flops += flops.num_floating_point_operations(self.config.model, global_batch, self.padded_vocab_size)
        if loss is not None and not math.isfinite(loss):
            self.nan += 1
        elif loss is not None and not skipped:
            self.losses.append(loss)

    def log_interval(self, state: TrainingState, optimizer, grad_norm: float | None) -> None:
        elapsed_s = self.seconds / self.config.logging.log_interval
        # As Megatron-LM, an iteration skipped for an fp16 overflow contributes no loss, and an interval in which
        # no iteration updated has no loss field (None; the skipped count says why). nan only when a loss was.
        lm_loss = sum(self.losses) / len(self.losses) if self.losses else math.nan if self.nan else None
        skipped, nan = self.skipped, self.nan  # counts for this interval, as in Megatron's line
        tflops_per_gpu = self.flops / (self.seconds * self.world_size) / 1e12
        tokens_per_second = self.tokens / self.seconds
        routing = self._routing_scalars()
        statistics = {name: sum(entry[name] for entry in self.statistics) / len(self.statistics)
                      for name in (self.statistics[0] if self.statistics else {})}
        self._reset()
        if not is_last_rank():
            return
        learning_rate, loss_scale = optimizer.param_groups[0]["lr"], float(optimizer.get_loss_scale())
        peak_memory = metrics.peak_memory_mb()
        print(metrics.format_iteration_log(
            iteration=state.iteration, train_iters=self.train_iters,
            consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed_s * 1000.0,
            tflops_per_gpu=tflops_per_gpu if self.config.logging.log_throughput else None,
            learning_rate=learning_rate, global_batch_size=self.global_batch,
            lm_loss=lm_loss, loss_scale=loss_scale, grad_norm=grad_norm, skipped_iterations=skipped,
            nan_iterations=nan, routing=routing, loss_name=self.loss_name, statistics=statistics), flush=True)
        if self.config.logging.log_memory:
            print(metrics.format_throughput_log(
                tokens_per_second=tokens_per_second, consumed_tokens=self.tokens_in(state.consumed_train_samples),
                mfu=metrics.model_flops_utilization(tflops_per_gpu, self.peak_tflops),
                peak_memory=peak_memory), flush=True)
        self._scalars(state.iteration, {
            self.loss_name: lm_loss, **statistics, "learning rate": learning_rate, "grad norm": grad_norm,
            "tokens per second": tokens_per_second, "loss scale": loss_scale, "batch size": self.global_batch,
            "consumed samples": state.consumed_train_samples,
            "consumed tokens": self.tokens_in(state.consumed_train_samples),
            "number of skipped iterations": skipped, "number of nan iterations": nan,
            "peak memory (MB)": peak_memory if self.config.logging.log_memory else None, **routing})

    def _routing_scalars(self) -> dict:
        """The interval's mixture-of-experts scalars: each auxiliary loss the run computes, averaged over the
        iterations (Megatron-LM's names), and the worst iteration's expert load max/min."""
        if not self.routing:
            return {}
        model = self.config.model
        balancing = BALANCING_LOSS_NAMES.get(model.moe_router_load_balancing_type)
        names = ([balancing] if balancing else []) + (["z_loss"] if model.moe_z_loss_coeff else [])
        scalars = {name: sum(r.losses[name] for r in self.routing) / len(self.routing) for name in names}
        scalars["expert load max/min"] = max(r.load_imbalance for r in self.routing)
        return scalars

    def log_validation(self, iteration: int, valid_loss: float | None, on: str | None = None) -> None:
        """``on``: which data, when not the validation set (``"test set"``)."""
        if valid_loss is None:  # not the last pipeline stage
            return
        print_rank_last(metrics.format_validation_log(iteration=iteration, lm_loss=valid_loss, on=on,
                                                      loss_name=self.loss_name))
        self._scalars(iteration, {f"{self.loss_name} test" if on else f"{self.loss_name} validation": valid_loss})

    def _scalars(self, iteration: int, values: dict) -> None:
        values = {name: value for name, value in values.items() if value is not None}
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        """Flushes the loggers' files (TensorBoard buffers its events; a W&B run is finished)."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
