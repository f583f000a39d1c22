"""The pretraining loop, top to bottom.

    pretrain(config)
      initialise processes, groups and seeds
      build the model chunks this rank holds, wrap them for data parallelism
      build the optimizer and LR schedule, load a checkpoint
      loop: train_step -> log -> evaluate -> save

Parallelism shows up only where it acts: ``build_model`` asks the pipeline split
which layers this rank holds, ``train_step`` hands the micro-batches to the
pipeline schedule, and the optimizer hides data-parallel sharding.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lite import checkpointing, collectives, kernels, metrics
from megatron_lite.config import Config
from megatron_lite.data import MockGPTDataset, build_pretraining_data_loader, build_train_valid_test_datasets
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.distributed.replica_check import check_weight_hash_across_dp_replicas
from megatron_lite.initialize import initialize_distributed
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_lite.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from megatron_lite.pipeline_parallel.layer_split import get_layer_numbers
from megatron_lite.pipeline_parallel.schedules import get_forward_backward_func
from megatron_lite.signal_handler import DistributedSignalHandler
from megatron_lite.tensor_parallel.random import model_parallel_seed
from megatron_lite.tokenizer import build_tokenizer


@dataclass
class TrainingState:
    """What the loop carries between iterations; checkpoints save it."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    losses: list = field(default_factory=list)  # lm loss per iteration, on the last pipeline stage


def set_random_seeds(seed: int, parallel_state: ParallelState) -> None:
    """Pipeline stages get different default streams (Megatron's seed + 100 x stage); dropout
    inside tensor-parallel regions uses the tracker's per-tensor-rank stream."""
    torch.manual_seed(seed + 100 * parallel_state.pipeline_model_parallel_rank)
    model_parallel_seed(seed, parallel_state.tensor_model_parallel_rank)


def build_model(config: Config, parallel_state: ParallelState, *, wrap_with_ddp: bool = True) -> list:
    """The model chunks this rank holds (one, or one per virtual stage), initialised
    layout-independently and wrapped for data-parallel gradient reduction."""
    parallel, training = config.parallel, config.training
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    device = _device()
    chunks = []
    for virtual_rank in range(vpp):
        layers = get_layer_numbers(
            config.model.num_layers, pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            pipeline_rank=parallel_state.pipeline_model_parallel_rank,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            virtual_pipeline_rank=virtual_rank,
            decoder_first_pipeline_num_layers=parallel.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=parallel.decoder_last_pipeline_num_layers)
        chunks.append(GPTModel(
            config.model, parallel_state, layer_numbers=layers,
            pre_process=parallel_state.is_pipeline_first_stage() and virtual_rank == 0,
            post_process=parallel_state.is_pipeline_last_stage() and virtual_rank == vpp - 1,
            sequence_parallel=parallel.sequence_parallel, params_dtype=config.params_dtype,
            recompute_granularity=training.recompute_granularity, recompute_method=training.recompute_method,
            recompute_num_layers=training.recompute_num_layers))
    initialize_weights(chunks, config.model, parallel_state, seed=training.seed)
    chunks = [chunk.to(device) for chunk in chunks]
    if not wrap_with_ddp:
        return chunks
    return [DistributedDataParallel(chunk, config=parallel, data_parallel_group=parallel_state.data_parallel_group)
            for chunk in chunks]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of the per-token loss of one micro-batch."""
    loss_mask = loss_mask.float()
    loss = torch.sum(output_tensor.float() * loss_mask) / loss_mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """One micro-batch through this rank's model chunk (Megatron's forward_step contract)."""
    batch = {k: v.to(_device(), non_blocking=True) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def build_data_iterators(config: Config, parallel_state: ParallelState, consumed_train_samples: int,
                         iteration: int = 0):
    """(train, valid) micro-batch iterators positioned where ``iteration`` iterations left them (so a
    resumed run continues with the same samples); a list of them, one per chunk, when interleaving."""
    training, data = config.training, config.data
    global_batch = training.global_batch(parallel_state.data_parallel_world_size)
    consumed_valid_samples = (iteration // training.eval_interval) * training.eval_iters * global_batch
    eod_token = _eod_token(data) if data.eod_mask_loss else None
    num_evaluations = training.train_iters // training.eval_interval + 1
    num_samples = (training.train_iters * global_batch, num_evaluations * training.eval_iters * global_batch,
                   training.eval_iters * global_batch)
    train_ds, valid_ds = _build_datasets(config, num_samples)[:2]
    vpp = config.parallel.virtual_pipeline_model_parallel_size or 1

    def loaders(dataset, consumed):
        if dataset is None:
            return None
        made = [build_pretraining_data_loader(
            dataset, consumed_samples=consumed, micro_batch_size=training.micro_batch_size,
            data_parallel_rank=parallel_state.data_parallel_rank,
            data_parallel_size=parallel_state.data_parallel_world_size,
            eod_token=eod_token, eod_mask_loss=data.eod_mask_loss) for _ in range(vpp)]
        return made if vpp > 1 else made[0]

    return loaders(train_ds, consumed_train_samples), loaders(valid_ds, consumed_valid_samples)


def _eod_token(data) -> int:
    return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                           tokenizer_model=data.tokenizer_model).eod


def _build_datasets(config: Config, num_samples: tuple):
    model, training, data = config.model, config.training, config.data
    if data.mock_data:
        return tuple(MockGPTDataset(vocab_size=model.vocab_size, seq_length=model.seq_length,
                                    seed=training.seed + split, num_samples=n) if n > 0 else None
                     for split, n in enumerate(num_samples))
    is_builder = not dist.is_initialized() or dist.get_rank() == 0
    kwargs = dict(data_path=data.data_path, split=data.split, seq_length=model.seq_length, seed=training.seed,
                  train_valid_test_num_samples=num_samples, data_cache_path=data.data_cache_path)
    # One rank builds the sample indices and caches them; the others then load the cache. If the
    # builder fails (a bad --data-path), every rank raises instead of waiting for its cache.
    datasets = collectives.run_on_every_rank(
        lambda: build_train_valid_test_datasets(is_builder_rank=True, **kwargs) if is_builder else None,
        lambda failed_rank: RuntimeError(f"rank {failed_rank} failed to build the datasets; its error says why."))
    if not is_builder:
        datasets = build_train_valid_test_datasets(is_builder_rank=False, **kwargs)
    return datasets


def _no_sync_all(model_chunks):
    """Suppress data-parallel gradient reduction in every chunk (non-final micro-batches)."""
    stack = contextlib.ExitStack()
    for chunk in model_chunks:
        stack.enter_context(chunk.no_sync())
    return stack


def train_step(config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler, data_iterator):
    """Forward and backward over every micro-batch of the global batch, then one optimizer step.

    Returns (mean lm loss on the last stage or None, update_successful, grad_norm)."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = _forward_backward(config, parallel_state, model_chunks, data_iterator, forward_only=False,
                               grad_scale_func=optimizer.scale_loss)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=1)
    return _average_loss(losses, parallel_state), update_successful, grad_norm


def _forward_backward(config, parallel_state, model_chunks, data_iterator, *, forward_only, grad_scale_func=None):
    model = config.model
    num_microbatches = config.training.num_microbatches(parallel_state.data_parallel_world_size)
    forward_backward = get_forward_backward_func(parallel_state)
    return forward_backward(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model_chunks,
        num_microbatches=num_microbatches, seq_length=model.seq_length,
        micro_batch_size=config.training.micro_batch_size, hidden_size=model.hidden_size,
        parallel_state=parallel_state, forward_only=forward_only, sequence_parallel=config.parallel.sequence_parallel,
        dtype=config.params_dtype, no_sync_func=functools.partial(_no_sync_all, model_chunks),
        finalize_model_grads_func=functools.partial(finalize_model_grads, parallel_state=parallel_state),
        grad_scale_func=grad_scale_func)


def _average_loss(losses: list, parallel_state: ParallelState) -> float | None:
    """Mean over micro-batches, then over data-parallel replicas (last stage only)."""
    if not parallel_state.is_pipeline_last_stage():
        return None
    loss = torch.stack([entry["lm loss"].float() for entry in losses]).mean().reshape(1)
    collectives.all_reduce(loss, parallel_state.data_parallel_group)
    return loss.item() / parallel_state.data_parallel_world_size


@torch.no_grad()
def evaluate(config: Config, parallel_state: ParallelState, model_chunks, data_iterator) -> float | None:
    """Mean validation loss over --eval-iters global batches, forward only."""
    for chunk in model_chunks:
        chunk.eval()
    losses = []
    for _ in range(config.training.eval_iters):
        step_losses = _forward_backward(config, parallel_state, model_chunks, data_iterator, forward_only=True)
        losses.append(_average_loss(step_losses, parallel_state))
    for chunk in model_chunks:
        chunk.train()
    return None if losses[0] is None else sum(losses) / len(losses)


def build_optimizer_and_scheduler(config: Config, parallel_state: ParallelState, model_chunks):
    optimizer = get_megatron_optimizer(config.optimizer, model_chunks, parallel_state=parallel_state,
                                       parallel_config=config.parallel, params_dtype=config.params_dtype)
    opt = config.optimizer
    wd_incr_steps = None if opt.start_weight_decay is None else config.training.train_iters
    scheduler = OptimizerParamScheduler(optimizer, max_lr=opt.lr, min_lr=opt.min_lr,
                                        lr_warmup_steps=opt.lr_warmup_iters, lr_decay_steps=opt.lr_decay_iters,
                                        lr_decay_style=opt.lr_decay_style, start_wd=opt.start_weight_decay,
                                        end_wd=opt.end_weight_decay, wd_incr_steps=wd_incr_steps,
                                        wd_incr_style=opt.weight_decay_incr_style)
    return optimizer, scheduler


def is_last_rank() -> bool:
    """Megatron prints from the last rank: it is on the last pipeline stage, which has the loss."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


def pretrain(config: Config, *, keep_process_group: bool = False):
    """Train as configured; returns (TrainingState, model chunks, parallel state)."""
    initialize_distributed(config.parallel)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    config.parallel.data_parallel_size(world_size)  # fails with the arithmetic before any group is built
    parallel_state = initialize_model_parallel(config.parallel.tensor_model_parallel_size,
                                               config.parallel.pipeline_model_parallel_size,
                                               config.parallel.virtual_pipeline_model_parallel_size)
    config.training.num_microbatches(parallel_state.data_parallel_world_size)  # batch arithmetic fails here, early
    set_random_seeds(config.training.seed, parallel_state)
    kernels.configure(config.model.use_fused_kernels)
    kernels.load_extension()  # a JIT build, if one is needed, happens now rather than inside step 1
    model_chunks = build_model(config, parallel_state)
    optimizer, scheduler = build_optimizer_and_scheduler(config, parallel_state, model_chunks)
    if config.logging.log_memory:
        print_rank_last(metrics.format_memory_report(optimizer.memory_report()))
    state = TrainingState()
    if config.checkpoint.load:
        state = checkpointing.load_checkpoint(config, parallel_state, model_chunks, optimizer, scheduler) or state
    train_iterator, valid_iterator = build_data_iterators(config, parallel_state, state.consumed_train_samples,
                                                          state.iteration)
    train(config, parallel_state, model_chunks, optimizer, scheduler, train_iterator, valid_iterator, state)
    if not keep_process_group:
        destroy_model_parallel(parallel_state)
    return state, model_chunks, parallel_state


def train(config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler, train_iterator,
          valid_iterator, state: TrainingState) -> None:
    training = config.training
    global_batch = training.global_batch(parallel_state.data_parallel_world_size)
    logger = TrainingLogger(config, parallel_state, global_batch)
    for chunk in model_chunks:
        chunk.train()
    signal_handler = DistributedSignalHandler() if training.exit_signal_handler else contextlib.nullcontext()
    with signal_handler:
        while state.iteration < training.train_iters:
            step_start = time.perf_counter()
            loss, update_successful, grad_norm = train_step(config, parallel_state, model_chunks, optimizer,
                                                            scheduler, train_iterator)
            state.iteration += 1
            state.consumed_train_samples += global_batch
            state.skipped_iterations += 0 if update_successful else 1
            if loss is not None:
                state.nan_iterations += 0 if math.isfinite(loss) else 1
                state.losses.append(loss)
            logger.record(loss, time.perf_counter() - step_start, skipped=not update_successful)
            if _every(state.iteration, training.check_weight_hash_across_dp_replicas_interval):
                check_weight_hash_across_dp_replicas(model_chunks, parallel_state, state.iteration)
            if _every(state.iteration, config.logging.log_interval):
                logger.log_interval(state, optimizer, grad_norm)
            if valid_iterator is not None and _every(state.iteration, training.eval_interval):
                logger.log_validation(state.iteration, evaluate(config, parallel_state, model_chunks, valid_iterator))
            exit_now = ((training.exit_signal_handler and signal_handler.signals_received(parallel_state))
                        or _every(state.iteration, training.exit_interval))
            save_now = (exit_now or state.iteration == training.train_iters  # as Megatron: save at the end
                        or _every(state.iteration, config.checkpoint.save_interval))
            if config.checkpoint.save and save_now:
                checkpointing.save_checkpoint(config, parallel_state, model_chunks, optimizer, scheduler, state)
            if exit_now:
                print_rank_last(f" exiting at iteration {state.iteration} (signal or --exit-interval)")
                return


def _every(iteration: int, interval: int | None) -> bool:
    return bool(interval) and iteration % interval == 0


class TrainingLogger:
    """Megatron's log line every --log-interval iterations, from the last rank (which has the loss),
    plus throughput, MFU and TensorBoard scalars."""

    def __init__(self, config: Config, parallel_state: ParallelState, global_batch: int):
        self.config = config
        self.global_batch = global_batch
        self.world_size = parallel_state.world_size
        self.flops_per_iteration = metrics.num_floating_point_operations(
            config.model, global_batch, config.model.padded_vocab_size(parallel_state.tensor_model_parallel_world_size))
        self.peak_tflops = metrics.device_peak_tflops(config.logging.peak_tflops)
        self.writer = metrics.tensorboard_writer(config.logging.tensorboard_dir) if is_last_rank() else None
        self.losses, self.seconds, self.skipped, self.nan = [], 0.0, 0, 0

    def record(self, loss: float | None, seconds: float, skipped: bool) -> None:
        """As Megatron: the interval's loss averages the iterations that updated the weights."""
        self.seconds += seconds
        self.skipped += int(skipped)
        if loss is not None and not math.isfinite(loss):
            self.nan += 1
        elif loss is not None and not skipped:
            self.losses.append(loss)

    def log_interval(self, state: TrainingState, optimizer, grad_norm: float | None) -> None:
        elapsed_s = self.seconds / self.config.logging.log_interval
        lm_loss = sum(self.losses) / max(len(self.losses), 1)
        skipped, nan = self.skipped, self.nan  # counts for this interval, as in Megatron's line
        self.losses, self.seconds, self.skipped, self.nan = [], 0.0, 0, 0
        if not is_last_rank():
            return
        tflops_per_gpu = self.flops_per_iteration / (elapsed_s * self.world_size) / 1e12
        learning_rate, loss_scale = optimizer.param_groups[0]["lr"], float(optimizer.get_loss_scale())
        print(metrics.format_iteration_log(
            iteration=state.iteration, train_iters=self.config.training.train_iters,
            consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed_s * 1000.0,
            tflops_per_gpu=tflops_per_gpu, learning_rate=learning_rate, global_batch_size=self.global_batch,
            lm_loss=lm_loss, loss_scale=loss_scale, grad_norm=grad_norm, skipped_iterations=skipped,
            nan_iterations=nan), flush=True)
        tokens_per_second = self.global_batch * self.config.model.seq_length / elapsed_s
        if self.config.logging.log_memory:
            print(metrics.format_throughput_log(
                tokens_per_second=tokens_per_second,
                mfu=metrics.model_flops_utilization(tflops_per_gpu, self.peak_tflops),
                peak_memory=metrics.peak_memory_mb()), flush=True)
        self._scalars(state.iteration, {"lm loss": lm_loss, "learning rate": learning_rate, "grad norm": grad_norm,
                                        "tokens per second": tokens_per_second, "loss scale": loss_scale})

    def log_validation(self, iteration: int, valid_loss: float | None) -> None:
        if valid_loss is None:  # not the last pipeline stage
            return
        print_rank_last(metrics.format_validation_log(iteration=iteration, lm_loss=valid_loss))
        self._scalars(iteration, {"lm loss validation": valid_loss})

    def _scalars(self, iteration: int, values: dict) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, iteration)
