"""The run's housekeeping around the steps: garbage collection, the CUDA cache, profiling, the wall clock.

Each is one of Megatron-LM's operational flags and acts where Megatron's loop does:

    --manual-gc [--manual-gc-interval N] [--no-manual-gc-eval]
        Python's collector stops running at arbitrary allocations (on each rank at a different
        moment, stalling the others in the next collective); it runs at iteration boundaries
        instead: every N iterations, and around each evaluation.
    --empty-unused-memory-level 1|2
        torch.cuda.empty_cache() after each forward-backward (and evaluation step), and with 2 also
        after the optimizer step: less fragmentation, at some speed. A no-op without CUDA.
    --profile --profile-step-start S --profile-step-end E [--profile-ranks R ...]
        a torch.profiler trace of iterations S..E-1 into --tensorboard-dir (TensorBoard's profiler
        plugin reads it), on the listed ranks (all when none are listed).
    --exit-duration-in-mins M
        save and stop once M minutes have passed since the start; ranks agree by an all-reduce MAX
        so all stop on the same iteration.
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist

from megatron_lite.config import Config, TrainingConfig
from megatron_lite.process_groups import collectives


@contextlib.contextmanager
def manual_garbage_collection(training: TrainingConfig):
    """With --manual-gc, Python's automatic collector is off inside the block (and back on after)."""
    if not training.manual_gc:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect_garbage_after_iteration(training: TrainingConfig, iteration: int) -> None:
    if training.manual_gc and training.manual_gc_interval and iteration % training.manual_gc_interval == 0:
        gc.collect()


@contextlib.contextmanager
def garbage_collection_around_evaluation(training: TrainingConfig):
    """As Megatron: a full collection before evaluating, and of the youngest generation (what
    evaluation made) after."""
    collect = training.manual_gc and training.manual_gc_eval
    if collect:
        gc.collect()
    yield
    if collect:
        gc.collect(generation=0)


def empty_unused_memory(training: TrainingConfig, level: int) -> None:
    """torch.cuda.empty_cache() at a point of ``level`` (1: after forward-backward, 2: after the step)."""
    if training.empty_unused_memory_level >= level:
        torch.cuda.empty_cache()  # does nothing when CUDA was never initialised


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def profiler(config: Config, rank: int):
    """Yields an object whose ``step()`` the loop calls at the start of every iteration.

    With --profile on a profiled rank it is a torch.profiler whose schedule records iterations
    [--profile-step-start, --profile-step-end) (1-based, as Megatron counts them): it waits
    start - 1 iterations, warms up for one, records end - start, then writes the trace."""
    logging = config.logging
    if not logging.profile or (logging.profile_ranks and rank not in logging.profile_ranks):
        yield _NoProfiler()
        return
    start, end = logging.profile_step_start, logging.profile_step_end
    schedule = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start,
                                       repeat=1)
    handler = torch.profiler.tensorboard_trace_handler(logging.tensorboard_dir, worker_name=f"rank{rank}")
    with torch.profiler.profile(schedule=schedule, on_trace_ready=handler) as prof:
        yield prof


def exit_duration_reached(training: TrainingConfig, start_time: float, parallel_state) -> bool:
    """Whether any rank has run --exit-duration-in-mins; a collective, so every rank calls it each iteration."""
    if training.exit_duration_in_mins is None:
        return False
    minutes = (time.time() - start_time) / 60.0
    group = dist.group.WORLD if parallel_state.world_size > 1 else None
    done = torch.tensor([int(minutes > training.exit_duration_in_mins)], dtype=torch.int32,
                        device=collectives.reduction_device([group]))
    collectives.all_reduce(done, group, op=dist.ReduceOp.MAX)
    return bool(done.item())
