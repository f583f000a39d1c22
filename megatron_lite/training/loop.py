"""The pretraining loop, top to bottom.

    pretrain(config)
      initialise processes, groups and seeds
      plan the run once: batch schedule, parameter counts, the checkpoint to load (run_plan)
      build the model chunks this rank holds, wrap them for data parallelism
      build the optimizer and LR schedule, load a checkpoint
      loop: train_step -> log -> evaluate -> save

Parallelism shows up only where it acts: ``get_model`` asks the pipeline split
which layers this rank holds, ``train_step`` hands the micro-batches to the
pipeline schedule, and the optimizer hides data-parallel sharding.

Progress is counted in samples, as in Megatron-LM: each iteration takes the global batch the
``NumMicroBatchesCalculator`` gives for the samples consumed so far (it grows under
--rampup-batch-size or --step-batch-size-schedule), and the LR schedule advances by that many samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time

import torch
import torch.distributed as dist

from megatron_lite import checkpointing, kernels
from megatron_lite.config import Config, TrainingConfig
from megatron_lite.data.preflight import check_data_paths
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.distributed.replica_check import check_weight_hash_across_dp_replicas
from megatron_lite.checkpointing.async_save import CheckpointSaver
from megatron_lite.checkpointing.save_lock import holding_save_lock
from megatron_lite.model.builder import FSDP_UNIT_MODULES, build_model, current_device
from megatron_lite.model import multi_token_prediction
from megatron_lite.model.document_rows import attention_input
from megatron_lite.model.moe import routing_statistics
from megatron_lite.model.moe.router import AuxLossScale
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.optimizer.optimizer_param_scheduler import get_optimizer_param_scheduler
from megatron_lite.pipeline_parallel.schedules import get_forward_backward_func
from megatron_lite.process_groups import collectives, failures, hang_report
from megatron_lite.process_groups.initialize import initialize_distributed
from megatron_lite.process_groups.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from megatron_lite.tensor_parallel.random import set_random_seeds
from megatron_lite.training import dpo, grpo, host_memory, metrics, operations
from megatron_lite.training.data_iterators import build_datasets, positioned_iterators, tokens_counter
from megatron_lite.planner import estimate_for_config, format_memory_estimate
from megatron_lite.training.logger import TrainingLogger, format_startup_summary, is_last_rank, print_rank_last
from megatron_lite.training.num_microbatches_calculator import NumMicroBatchesCalculator
from megatron_lite.training.rerun_state_machine import (IterationBatch, RerunStateMachine, ResultRejected,
                                                        wrap_data_iterator)
from megatron_lite.training.restarts import describe_restart
from megatron_lite.training.run_plan import RunPlan, plan_run
from megatron_lite.training.signal_handler import DistributedSignalHandler
from megatron_lite.training.straggler import StragglerDetector
from megatron_lite.checkpointing.training_state import TrainingState


def get_model(config: Config, parallel_state: ParallelState) -> list[DistributedDataParallel]:
    """This rank's model chunks wrapped for data-parallel gradient reduction (Megatron's get_model): expert
    weights over the expert-data-parallel group, the rest over the data x context ranks, whose gradients are
    each a part of the global batch's."""
    groups = dict(data_parallel_group=parallel_state.data_parallel_group_with_context,
                  expert_data_parallel_group=parallel_state.expert_data_parallel_group)
    return [DistributedDataParallel(chunk, config=config.parallel, fsdp_unit_modules=FSDP_UNIT_MODULES, **groups)
            for chunk in build_model(config, parallel_state)]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, mtp_losses: dict | None = None):
    """(sum of the masked per-token losses, number of loss tokens, {"lm loss": [sum, count]}) of one
    micro-batch, Megatron-Core's form: the schedule turns it into a micro-batch mean, or with a per-token
    loss leaves the division by the global batch's count to finalize_model_grads. ``mtp_losses``: the
    multi-token prediction losses to log beside it (``multi_token_prediction.logged_losses``)."""
    loss_mask = loss_mask.float()
    loss_sum = torch.sum(output_tensor.float() * loss_mask)
    num_tokens = loss_mask.sum().long()
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()]),
                                  **(mtp_losses or {})}


def forward_step(data_iterator, model):
    """One micro-batch through this rank's model chunk (Megatron's forward_step contract). Packed
    fine-tuning batches carry their documents (``document_ids``); without them, attention is causal. The
    position ids go to the model as they are, on the host: it reads there whether they are the tokens' columns
    (Llama 4's chunked attention folds its chunks then) without reading anything back from the device."""
    batch = {k: v if k == "position_ids" else v.to(current_device(), non_blocking=True)
             for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], attention_input(batch), labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, functools.partial(loss_func, batch["loss_mask"],
                                     mtp_losses=multi_token_prediction.logged_losses(model))


def calculate_per_token_loss(config: Config) -> bool:
    """Whether the loss is summed over tokens and divided by the global batch's loss-token count
    (--calculate-per-token-loss, as Megatron) rather than averaged per micro-batch. Fine-tuning always
    does this (docs/reference.md section 10): examples count by their response tokens, not by the micro-batch
    they landed in."""
    return config.training.calculate_per_token_loss or config.data.sft


def train_step(config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler, data_iterator,
               num_microbatches: int, *, forward_step_func=forward_step):
    """Forward and backward over ``num_microbatches`` micro-batches per data-parallel rank, then one
    optimizer step; the LR schedule advances by the samples this global batch held.

    ``forward_step_func`` follows ``forward_step``'s contract (Megatron's train_step takes it too): the
    GPT's by default, any other model's in tests that train one through this same step.

    Returns (lm loss: the global batch's per-token mean on the last stage, else None; update_successful;
    grad_norm)."""
    losses, update_successful, grad_norm = train_step_with_losses(
        config, parallel_state, model_chunks, optimizer, scheduler, data_iterator, num_microbatches,
        forward_step_func=forward_step_func)
    return _main_loss(losses), update_successful, grad_norm


def train_step_with_losses(config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler,
                           data_iterator, num_microbatches: int, *, forward_step_func=forward_step,
                           forward_backward_func=None, rerun_state_machine: RerunStateMachine | None = None):
    """``train_step`` returning every logged loss of the global batch ({name: mean} on the last stage, the
    main loss first, else None). ``forward_backward_func`` replaces the forward and backward over the
    micro-batches (``_forward_backward``'s signature): --dpo's adds the reference's pass before them.
    ``rerun_state_machine`` validates the results before the optimizer step and re-runs the forward and
    backward when one is rejected (the loop's; None: no validation)."""
    forward_backward_func = forward_backward_func or _forward_backward

    def forward_and_backward():
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # Mixture-of-experts routers and multi-token prediction: their losses' gradient follows the
        # language-model loss's scaling.
        loss_scale = AuxLossScale(optimizer.get_loss_scale(), num_microbatches, calculate_per_token_loss(config),
                                  parallel_state.context_parallel_world_size)
        routing_statistics.start_iteration(model_chunks, loss_scale)
        multi_token_prediction.start_iteration(model_chunks, loss_scale)
        return forward_backward_func(config, parallel_state, model_chunks, data_iterator, num_microbatches,
                                     forward_only=False, grad_scale_func=optimizer.scale_loss,
                                     forward_step_func=forward_step_func)

    if rerun_state_machine is None:
        losses = forward_and_backward()
    else:
        losses = rerun_state_machine.run(forward_and_backward, data_iterator, model_chunks)
    routing_statistics.update_expert_bias(model_chunks, parallel_state)  # once per global batch
    operations.empty_unused_memory(config.training, level=1)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        global_batch = num_microbatches * config.training.micro_batch_size * parallel_state.data_parallel_world_size
        scheduler.step(increment=global_batch)
    operations.empty_unused_memory(config.training, level=2)
    return average_losses(losses, parallel_state), update_successful, grad_norm


def _forward_backward(config, parallel_state, model_chunks, data_iterator, num_microbatches, *, forward_only,
                      grad_scale_func=None, forward_step_func=forward_step):
    model = config.model
    forward_backward = get_forward_backward_func(parallel_state)
    return forward_backward(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model_chunks,
        num_microbatches=num_microbatches, seq_length=model.seq_length // parallel_state.context_parallel_world_size,
        micro_batch_size=config.training.micro_batch_size, hidden_size=model.hidden_size,
        parallel_state=parallel_state, forward_only=forward_only, sequence_parallel=config.parallel.sequence_parallel,
        # One no_sync per chunk, as Megatron: the schedule lets each chunk's gradient reduction start
        # before that chunk's own last backward, so with --overlap-grad-reduce every chunk's buckets
        # reduce behind the remaining backwards (interleaved chunks finish their backwards at different times).
        dtype=config.params_dtype,
        no_sync_func=None if forward_only else [chunk.no_sync for chunk in model_chunks],
        finalize_model_grads_func=functools.partial(finalize_model_grads, parallel_state=parallel_state),
        grad_scale_func=grad_scale_func, calculate_per_token_loss=calculate_per_token_loss(config))


def _average_loss(losses: list, parallel_state: ParallelState) -> float | None:
    """The main loss of the global batch (last stage only; see ``average_losses``)."""
    return _main_loss(average_losses(losses, parallel_state))


def _main_loss(losses: dict | None) -> float | None:
    return None if losses is None else next(iter(losses.values()))


def average_losses(losses: list, parallel_state: ParallelState) -> dict | None:
    """Each logged loss of the global batch (last stage only): the mean over every micro-batch and
    data-parallel replica, as Megatron reports ``[sum, count]`` losses (each context-parallel rank holds
    the sums of its own positions, so they are added too), in the loss dicts' order. A global batch without
    loss tokens (fine-tuning data that is all prompt) reports 0 where Megatron's 0/0 logs NaN: it trained on
    nothing, which is no divergence to count as a nan iteration."""
    if not parallel_state.is_pipeline_last_stage():
        return None
    names = list(losses[0])
    total = torch.stack([torch.stack([entry[name].float() for name in names]) for entry in losses]).sum(dim=0)
    collectives.all_reduce(total, parallel_state.data_parallel_group_with_context)  # one collective for all
    return {name: (sum_ / count.clamp(min=1)).item() for name, (sum_, count) in zip(names, total)}


@torch.no_grad()
def evaluate(config: Config, parallel_state: ParallelState, model_chunks, data_iterator, *,
             forward_backward_func=None) -> float | None:
    """Validation loss over --eval-iters global batches (the full size, after any ramp-up), forward only:
    the mean over all their loss tokens (``forward_backward_func`` as ``train_step_with_losses``')."""
    forward_backward_func = forward_backward_func or _forward_backward
    num_microbatches = config.training.num_microbatches(parallel_state.data_parallel_world_size)
    for chunk in model_chunks:
        chunk.eval()
    losses = []
    for _ in range(config.training.eval_iters):
        losses += forward_backward_func(config, parallel_state, model_chunks, data_iterator, num_microbatches,
                                        forward_only=True)
        operations.empty_unused_memory(config.training, level=1)
    for chunk in model_chunks:
        chunk.train()
    return _average_loss(losses, parallel_state)


def build_optimizer_and_scheduler(config: Config, parallel_state: ParallelState, model_chunks):
    optimizer = get_megatron_optimizer(config.optimizer, model_chunks, parallel_state=parallel_state,
                                       parallel_config=config.parallel, params_dtype=config.params_dtype)
    global_batch = config.training.global_batch(parallel_state.data_parallel_world_size)
    return optimizer, get_optimizer_param_scheduler(optimizer, config, global_batch)


def setup_model_and_optimizer(config: Config, parallel_state: ParallelState):
    """(model chunks, optimizer, LR schedule) of this rank, seeded and with the kernels chosen, before any
    checkpoint is loaded (Megatron's setup_model_and_optimizer): what a test that steps ``train_step`` by
    hand builds too."""
    set_random_seeds(config.training.seed, parallel_state)
    if current_device().type == "cpu":
        host_memory.keep_freed_memory()  # each step's large tensors reuse the last step's pages
    kernels.configure(config.model.use_fused_kernels)
    kernels.load_extension()  # a JIT build, if one is needed, happens now rather than inside step 1
    model_chunks = get_model(config, parallel_state)
    optimizer, scheduler = build_optimizer_and_scheduler(config, parallel_state, model_chunks)
    return model_chunks, optimizer, scheduler


def pretrain(config: Config, *, keep_process_group: bool = False):
    """Train as configured; returns (TrainingState, model chunks, parallel state)."""
    start_time = time.time()  # --exit-duration-in-mins counts from here
    initialize_distributed(config.parallel)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    config.parallel.data_parallel_size(world_size)  # fails with the arithmetic before any group is built
    parallel_state = initialize_model_parallel(config.parallel.tensor_model_parallel_size,
                                               config.parallel.pipeline_model_parallel_size,
                                               config.parallel.virtual_pipeline_model_parallel_size,
                                               context_parallel_size=config.parallel.context_parallel_size,
                                               expert_model_parallel_size=config.parallel.expert_model_parallel_size,
                                               expert_tensor_parallel_size=config.parallel.expert_tensor_parallel_size,
                                               distributed_timeout_minutes=config.parallel.distributed_timeout_minutes)
    # The data first: --train-epochs reads it to plan the run, and a bad path or record says so before that.
    failures.run_on_every_rank(lambda: check_data_paths(config.data), "check the data paths")
    plan = plan_run(config, parallel_state)
    if not plan.resumes:  # a fresh run's batches all lie ahead: any that cannot split fails now, early
        check_batches_ahead(config, plan.calculator, consumed_samples=0)
    print_rank_last(format_startup_summary(config, parallel_state, plan))
    grpo_inputs = None
    if config.data.grpo:  # its prompts and reward functions fail now, before the model is built
        grpo_inputs = failures.run_on_every_rank(lambda: grpo.read_inputs(config, parallel_state, plan.train_iters),
                                                 "read --grpo's prompts and reward functions")
    if (restart := describe_restart(plan.checkpoint)) is not None:
        print_rank_last(restart)
    model_chunks, optimizer, scheduler = setup_model_and_optimizer(config, parallel_state)
    if config.logging.log_memory:
        _print_memory(config, parallel_state, optimizer)
    state = TrainingState()
    if config.checkpoint.load or config.checkpoint.pretrained_checkpoint:
        state = checkpointing.load_checkpoint_from(plan.checkpoint, config, parallel_state, model_chunks, optimizer,
                                                   scheduler) or state
    if state.iteration >= plan.train_iters > 0:  # a finished run started again (a requeue): say so, not nothing
        print_rank_last(f" already at --train-iters {plan.train_iters} (the checkpoint is at iteration "
                        f"{state.iteration}); nothing to do. Raise --train-iters (or --train-samples) to train "
                        f"further.")
    # Every rank holds the same consumed samples, so all raise together, before any collective of training.
    check_batches_ahead(config, plan.calculator, state.consumed_train_samples)
    inputs = _loop_inputs(config, parallel_state, model_chunks, plan, state, grpo_inputs)
    train(config, parallel_state, model_chunks, optimizer, scheduler, inputs.train_iterator, inputs.valid_iterator,
          state, inputs.test_iterator, plan=plan, start_time=start_time,
          forward_backward_func=inputs.forward_backward_func, tokens_in=inputs.tokens_in)
    if not keep_process_group:
        destroy_model_parallel(parallel_state)
    return state, model_chunks, parallel_state


def _print_memory(config: Config, parallel_state: ParallelState, optimizer) -> None:
    """The memory the optimizer holds, and the planner's estimate for this rank beside it (the planner models
    full training, not --peft)."""
    report = optimizer.memory_report()
    print_rank_last(metrics.format_memory_report(report))
    if is_last_rank() and config.peft.peft is None:
        last = parallel_state.world_size - 1
        print(format_memory_estimate(estimate_for_config(config, parallel_state.world_size, rank=last), report),
              flush=True)


@dataclasses.dataclass
class _LoopInputs:
    """What feeds the loop: the data iterators (None under --grpo, which samples its own batches), the token
    counter of the training samples, and the forward-backward function (None: the language-model loss's)."""
    train_iterator: object = None
    valid_iterator: object = None
    test_iterator: object = None
    tokens_in: object = None
    forward_backward_func: object = None


def _loop_inputs(config: Config, parallel_state: ParallelState, model_chunks, plan: RunPlan, state: TrainingState,
                 grpo_inputs) -> _LoopInputs:
    """The batches from the position ``state`` has reached, and --grpo's or --dpo's forward-backward."""
    if config.data.grpo:  # it samples its own batches of completions from the prompts
        return _LoopInputs(forward_backward_func=grpo.GroupRelativePolicyOptimization(
            config, parallel_state, model_chunks, grpo_inputs, run_schedule=_forward_backward,
            start_iteration=state.iteration).forward_backward)
    datasets = build_datasets(config, plan)
    inputs = _LoopInputs(*positioned_iterators(config, parallel_state, datasets, state.consumed_train_samples,
                                               state.iteration),
                         tokens_in=tokens_counter(config, datasets[0]))
    if config.data.dpo:  # the frozen reference's pass before the policy's (built after the policy is loaded)
        preference = dpo.DirectPreferenceOptimization(config, parallel_state, model_chunks,
                                                      run_schedule=_forward_backward)
        if config.training.dpo_precompute_ref_log_probs:  # one pass ahead over the same micro-batches, then freed
            inputs.train_iterator, inputs.valid_iterator, inputs.test_iterator = preference.precompute_reference(
                config, parallel_state, (inputs.train_iterator, inputs.valid_iterator, inputs.test_iterator),
                positioned_iterators(config, parallel_state, datasets, state.consumed_train_samples, state.iteration),
                micro_batches_ahead(config, parallel_state, plan.train_iters, state.iteration))
        inputs.forward_backward_func = preference.forward_backward
    return inputs


def micro_batches_ahead(config: Config, parallel_state: ParallelState, train_iters: int,
                        iteration: int) -> tuple[int, int, int]:
    """The micro-batches a run at ``iteration`` will read from each split (train, validation, test), per data-parallel
    rank, as ``_train`` reads them: a fixed batch each iteration, --eval-iters of them at each --eval-interval."""
    training = config.training
    per_batch = training.num_microbatches(parallel_state.data_parallel_world_size)
    evaluations = train_iters // training.eval_interval - iteration // training.eval_interval
    return (train_iters - iteration) * per_batch, evaluations * training.eval_iters * per_batch, \
        training.eval_iters * per_batch


def check_batches_ahead(config: Config, calculator: NumMicroBatchesCalculator, consumed_samples: int) -> None:
    """The batches the run has still to take split over the replicas, and with the interleaved schedule into
    a multiple of the pipeline stages. Only those ahead, as Megatron checks each batch when it comes: a run
    may resume with more data-parallel ranks once the small early batches are behind it."""
    calculator.check_batches_ahead(consumed_samples)
    for count in calculator.microbatch_counts(consumed_samples):
        config.parallel.check_interleaved_microbatches(count)


def train(config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler, train_iterator,
          valid_iterator, state: TrainingState, test_iterator=None, *, plan: RunPlan, start_time: float,
          forward_backward_func=None, tokens_in=None) -> None:
    """``forward_backward_func``: as ``train_step_with_losses``' (None: the language-model loss's). ``tokens_in(n)``:
    the tokens of the first n training samples (build_data_iterators'); default n x --seq-length."""
    calculator, train_iters = plan.calculator, plan.train_iters
    logger = TrainingLogger(config, parallel_state, train_iters, tokens_in)
    start = dataclasses.replace(state, losses=list(state.losses))
    loop_start = time.perf_counter()
    try:
        _train(config, parallel_state, model_chunks, optimizer, scheduler, train_iterator, valid_iterator, state,
               test_iterator, calculator=calculator, train_iters=train_iters, start_time=start_time, logger=logger,
               forward_backward_func=forward_backward_func)
    finally:  # the TensorBoard and W&B files hold every logged scalar, also when the run stops early
        logger.close()
    print_training_summary(config, start, state, time.perf_counter() - loop_start, logger.tokens_in)


def print_training_summary(config: Config, start: TrainingState, end: TrainingState, seconds: float,
                           tokens_in) -> None:
    """The closing line of the iterations this run took (``start`` is the state before the first): a run
    shorter than --log-interval has printed no loss otherwise. ``tokens_in(n)``: the tokens trained on in the
    first n samples (the logger's)."""
    iterations = end.iteration - start.iteration
    if iterations and is_last_rank():  # the last rank is on the last pipeline stage, which has the losses
        tokens = tokens_in(end.consumed_train_samples) - tokens_in(start.consumed_train_samples)
        print(metrics.format_training_summary(iterations=iterations, first_iteration=start.iteration + 1,
                                              tokens=tokens, losses=end.losses[len(start.losses):],
                                              seconds=seconds, loss_name=metrics.loss_name(config.data)),
              flush=True)


def _train(config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler, train_iterator,
           valid_iterator, state: TrainingState, test_iterator, *, calculator: NumMicroBatchesCalculator,
           train_iters: int, start_time: float, logger: TrainingLogger, forward_backward_func=None) -> None:
    """Megatron-LM's ``train()``: each iteration a training step, its log, the weight check, an evaluation and a
    save when due, and the exit checks; the test data once at the end."""
    training = config.training
    _enter_training(model_chunks)
    signal_handler = DistributedSignalHandler() if training.exit_signal_handler else contextlib.nullcontext()
    loop = _TrainingLoop(config, parallel_state, model_chunks, optimizer, scheduler, logger, forward_backward_func,
                         saved_iteration=state.iteration)
    if loop.rerun.replays_data:
        train_iterator = wrap_data_iterator(train_iterator)
    first_iteration = state.iteration + 1
    # The save lock covers every save of the run: a second run on the same --save stops before its first step.
    with holding_save_lock(config.checkpoint.save, is_holder=parallel_state.rank == 0), signal_handler, \
            hang_report.reporting_hangs(config.parallel.distributed_timeout_minutes,
                                        setting="--distributed-timeout-minutes"), \
            operations.manual_garbage_collection(training), \
            operations.profiler(config, parallel_state.rank) as profiler:
        while state.iteration < train_iters:
            profiler.step()
            num_microbatches = calculator.get_num_microbatches(state.consumed_train_samples)
            step = loop.train_iteration(state, train_iterator, num_microbatches,
                                        calculator.get_current_global_batch_size(state.consumed_train_samples))
            if config.logging.log_memory and state.iteration == first_iteration:
                print_rank_last(metrics.format_memory_report(optimizer.memory_report(), state.iteration))
            loop.record(state, step)
            if _every(state.iteration, training.check_weight_hash_across_dp_replicas_interval):
                check_weight_hash_across_dp_replicas(model_chunks, parallel_state, state.iteration)
            if _every(state.iteration, config.logging.log_interval):
                loop.training_log(state, step.grad_norm)
            if valid_iterator is not None and _every(state.iteration, training.eval_interval):
                loop.validate(state.iteration, valid_iterator)
            operations.collect_garbage_after_iteration(training, state.iteration)
            exit_now = _exit_requested(training, signal_handler, parallel_state, state.iteration, start_time)
            # As Megatron: save at the end, and when the batch schedule changes the micro-batch count (a resume
            # may then change the data-parallel size to suit the larger batch).
            batch_grows = calculator.get_num_microbatches(state.consumed_train_samples) != num_microbatches
            loop.save_if_due(state, exit_now or state.iteration == train_iters or batch_grows)
            if exit_now:
                loop.saver.finalize()
                print_rank_last(f" exiting at iteration {state.iteration} (signal, --exit-interval or "
                                f"--exit-duration-in-mins)")
                return
        loop.saver.finalize()  # inside the save lock: the run's last checkpoint is committed before it is released
    if test_iterator is not None:  # as Megatron, the test data is evaluated once, after training
        logger.log_validation(state.iteration, loop.evaluate(test_iterator), on="test set")


def _enter_training(model_chunks) -> None:
    """Training mode, and the peak-memory counters reset so that the first iteration's peak is reported."""
    for chunk in model_chunks:
        chunk.train()
        chunk.reset_peak_memory()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


@dataclasses.dataclass
class _Step:
    """What one training iteration gave: its losses and main loss (None off the last pipeline stage), whether the
    optimizer stepped, the gradient norm, the global batch it took and its time."""
    losses: dict | None
    loss: float | None
    update_successful: bool
    grad_norm: float | None
    global_batch: int
    seconds: float


class _TrainingLoop:
    """The parts every iteration of ``_train`` uses, built once for the run: the model, optimizer and schedule,
    the logger, the checkpoint saver, the rerun state machine, the straggler detector; and the iteration of the
    newest checkpoint of this run's state (at first the one it started from)."""

    def __init__(self, config: Config, parallel_state: ParallelState, model_chunks, optimizer, scheduler,
                 logger: TrainingLogger, forward_backward_func, *, saved_iteration: int):
        self.config, self.parallel_state = config, parallel_state
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.logger, self.forward_backward_func = logger, forward_backward_func
        self.saved_iteration = saved_iteration
        self.saver = CheckpointSaver(config, parallel_state)
        self.rerun = RerunStateMachine(config.training, parallel_state,
                                       has_loss_scaler=optimizer.grad_scaler is not None)
        self.straggler = StragglerDetector() if config.logging.log_straggler else None

    def train_iteration(self, state: TrainingState, train_iterator, num_microbatches: int,
                        global_batch: int) -> _Step:
        """One ``train_step`` and the state's counts after it. A result the rerun state machine rejects saves
        the state from before the iteration and stops every rank."""
        step_start = time.perf_counter()
        collectives.tracker.iteration = state.iteration + 1
        self.rerun.begin_iteration(IterationBatch(state.iteration + 1, state.consumed_train_samples, global_batch,
                                                  num_microbatches))
        try:
            losses, update_successful, grad_norm = train_step_with_losses(
                self.config, self.parallel_state, self.model_chunks, self.optimizer, self.scheduler, train_iterator,
                num_microbatches, forward_backward_func=self.forward_backward_func, rerun_state_machine=self.rerun)
        except ResultRejected as rejected:
            self._save_before_stopping(state)
            rejected.raise_on_every_rank()
        loss = _main_loss(losses)
        state.iteration += 1
        state.consumed_train_samples += global_batch
        state.skipped_iterations += 0 if update_successful else 1
        if loss is not None:
            state.nan_iterations += 0 if math.isfinite(loss) else 1
            state.losses.append(loss)
        return _Step(losses, loss, update_successful, grad_norm, global_batch, time.perf_counter() - step_start)

    def record(self, state: TrainingState, step: _Step) -> None:
        """The iteration's numbers into the logger's interval (and its time into the straggler detector)."""
        if self.straggler is not None:
            self.straggler.record(step.seconds)
        self.logger.record(step.loss, step.seconds, skipped=not step.update_successful,
                           global_batch=step.global_batch, statistics=step.losses,
                           consumed_samples=state.consumed_train_samples,
                           routing=routing_statistics.routing_summary(self.model_chunks, self.parallel_state,
                                                                      self.config.model))

    def training_log(self, state: TrainingState, grad_norm: float | None) -> None:
        """The --log-interval line, with the rerun machine's and the straggler detector's reports."""
        self.logger.log_interval(state, self.optimizer, grad_norm)
        self.rerun.log_statistics(state.iteration)
        if self.straggler is not None:
            self.straggler.report(state.iteration)

    def evaluate(self, data_iterator) -> dict | None:
        return evaluate(self.config, self.parallel_state, self.model_chunks, data_iterator,
                        forward_backward_func=self.forward_backward_func)

    def validate(self, iteration: int, valid_iterator) -> None:
        with operations.garbage_collection_around_evaluation(self.config.training):
            valid_loss = self.evaluate(valid_iterator)
        self.logger.log_validation(iteration, valid_loss)

    def save_if_due(self, state: TrainingState, due: bool) -> None:
        """A checkpoint when ``due`` or at --save-interval; then any asynchronous save that has finished is
        committed."""
        if self.config.checkpoint.save and (due or _every(state.iteration, self.config.checkpoint.save_interval)):
            self.saver.save(self.model_chunks, self.optimizer, self.scheduler, state)
            self.saved_iteration = state.iteration
        self.saver.maybe_finalize()

    def _save_before_stopping(self, state: TrainingState) -> None:
        """A rejected result reproduced: the state before its iteration (the weights, the random states and the
        data position it started from) is saved unless it already is, so the iteration can be re-run elsewhere."""
        if self.config.checkpoint.save and state.iteration > self.saved_iteration:
            self.saver.save(self.model_chunks, self.optimizer, self.scheduler, state)
        self.saver.finalize()


def _exit_requested(training: TrainingConfig, signal_handler, parallel_state: ParallelState, iteration: int,
                    start_time: float) -> bool:
    """A signal on any rank, --exit-interval or --exit-duration-in-mins; collectives, so every rank asks."""
    return ((training.exit_signal_handler and signal_handler.signals_received(parallel_state))
            or _every(iteration, training.exit_interval)
            or operations.exit_duration_reached(training, start_time, parallel_state))


def _every(iteration: int, interval: int | None) -> bool:
    return bool(interval) and iteration % interval == 0
