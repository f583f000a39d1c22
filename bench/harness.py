"""Measuring a real run for the planner: activation memory and static memory (tests/planner), step time
(bench_step_time). Here, not in tests/, because benchmarks never import the tests; tests may import it.

Activation memory is what autograd keeps for backward. ``SavedActivationPeak`` sees
every tensor saved during the forward passes (``saved_tensors_hooks``) and learns
when autograd drops it (the packed holder is freed), counting each storage once, and
records the largest total alive at any moment of a training step: across the
pipeline schedule's in-flight micro-batches and recomputation's rebuilt activations.
Parameters (and the flat buffers they are views of) are not activations.
"""
from __future__ import annotations

import resource
import time

import torch


class _Held:
    """A saved tensor, as autograd stores it while the hook is active; freed when autograd drops it."""

    def __init__(self, tensor: torch.Tensor, tracker: "SavedActivationPeak", key: int):
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self):
        self.tracker.release(self.key)


class SavedActivationPeak:
    def __init__(self, parameters):
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.count: dict = {}  # storage -> (holders alive, bytes)
        self.alive = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or storage.nbytes() == 0:
            return tensor
        holders, size = self.count.get(key, (0, storage.nbytes()))
        if holders == 0:
            self.alive += size
            self.peak = max(self.peak, self.alive)
        self.count[key] = (holders + 1, size)
        return _Held(tensor, self, key)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def release(self, key: int) -> None:
        holders, size = self.count[key]
        if holders == 1:
            del self.count[key]
            self.alive -= size
        else:
            self.count[key] = (holders - 1, size)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def first_step_memory(step, warm_up_length: int, kept_out: list) -> dict:
    """Memory of one ``step()``: the resident peak it adds (after ``step(warm_up_length)`` ran the libraries'
    first-call set-up outside it) and the peak of what autograd keeps for its backward (``kept_out``: tensors,
    parameters among them, that are not activations)."""
    step(warm_up_length)
    before = _peak_resident_bytes()
    with SavedActivationPeak(kept_out) as saved:
        step()
    return {"peak_added": _peak_resident_bytes() - before, "saved": saved.peak}


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes


def _scheduler_seconds() -> tuple[float, float]:
    """(CPU time, time runnable but waiting for a CPU) of this thread so far, from Linux's schedstat."""
    with open("/proc/thread-self/schedstat") as f:
        running, waiting, _ = f.read().split()
    return int(running) / 1e9, int(waiting) / 1e9


def run_layout(config, *, timed_steps: int = 0) -> dict:
    """One training step of ``config`` on this rank (the loop's own ``train_step``), measured.

    Returns the rank's coordinates, ``optimizer.memory_report()``, the peak saved activation
    bytes of the step, and (with ``timed_steps``) the wall, CPU and CPU-wait seconds of that
    many further steps.
    """
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.training.data_iterators import build_data_iterators
    from megatron_lite.training.loop import setup_model_and_optimizer, train_step
    from megatron_lite.training.run_plan import plan_run

    parallel = config.parallel
    state = initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                      parallel.virtual_pipeline_model_parallel_size,
                                      context_parallel_size=parallel.context_parallel_size)
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, state)
    data = build_data_iterators(config, state, plan_run(config, state), 0)[0]
    num_microbatches = config.training.num_microbatches(state.data_parallel_world_size)
    parameters = [p for chunk in chunks for p in chunk.module.parameters()]
    with SavedActivationPeak(parameters) as tracker:
        train_step(config, state, chunks, optimizer, scheduler, data, num_microbatches)
    steps = []  # (wall seconds, CPU seconds, seconds waiting for a CPU) of each timed step
    for _ in range(timed_steps):
        torch.distributed.barrier()
        start, (running, waiting) = time.perf_counter(), _scheduler_seconds()
        train_step(config, state, chunks, optimizer, scheduler, data, num_microbatches)
        torch.distributed.barrier()
        end, (running_end, waiting_end) = time.perf_counter(), _scheduler_seconds()
        steps.append((end - start, running_end - running, waiting_end - waiting))
    result = {"pipeline_rank": state.pipeline_model_parallel_rank, "data_parallel_rank": state.data_parallel_rank,
              "memory_report": optimizer.memory_report(), "activation_peak": tracker.peak,
              "steps": steps}
    destroy_model_parallel(state)
    return result


def run_layouts(rank: int, world_size: int, configs: list, timed_steps: int = 0) -> list:
    """``run_layout`` for each config in turn (run_distributed's entry point)."""
    return [run_layout(config, timed_steps=timed_steps) for config in configs]


def launch_layouts(world_size: int, configs: list, timed_steps: int = 0) -> list:
    """``run_layouts`` on ``world_size`` fresh local ranks (``calibrate.run_on_local_processes``); one result list
    per rank, in rank order (the benchmarks' entry point: bench does not use the tests' process fixture)."""
    from megatron_lite.planner.calibrate import run_on_local_processes

    return run_on_local_processes(run_layouts, world_size, configs, timed_steps)
