"""What the pipeline schedule costs, read off the schedule tables the training run executes.

The bubble comes from ``timeline.simulate`` playing every rank's table; the activations
a rank holds at once from walking its own table. Both use a table of at most 2p
micro-batches: past the warm-up every further micro-batch adds exactly one forward
and one backward to every rank and one more alive-then-freed activation, so the idle
time and the peak do not change (a test checks this against full tables). That keeps
enumerating thousands of layouts fast.
"""
from __future__ import annotations

import functools

from megatron_lite.pipeline_parallel.schedule_table import OpKind, build_schedule, compute_order
from megatron_lite.pipeline_parallel.timeline import simulate


def table_microbatches(num_microbatches: int, pipeline_model_parallel_size: int) -> int:
    """Micro-batches of the table that stands in for ``num_microbatches`` (a multiple of p when m is)."""
    return min(num_microbatches, 2 * pipeline_model_parallel_size)


@functools.lru_cache(maxsize=None)
def _idle_time(p: int, m: int, v: int) -> float:
    """Idle time of the tables with a stage's forward taking 1 and its backward 2."""
    timeline = simulate(build_schedule(p, m, v), forward_time=1.0, backward_time=2.0)
    return timeline.makespan - timeline.ideal_time


def bubble_fraction(pipeline_model_parallel_size: int, num_microbatches: int, num_model_chunks: int = 1) -> float:
    """Idle over ideal time of the schedule: (p-1)/m for 1F1B, (p-1)/(v m) interleaved, from the tables.

    Every stage waits for whole forward+backward pairs of the others, so the fraction does
    not depend on how a backward compares with a forward (recomputation changes neither).
    """
    p, m, v = pipeline_model_parallel_size, num_microbatches, num_model_chunks
    if p == 1:
        return 0.0
    return _idle_time(p, table_microbatches(m, p), v) / (m * 3.0)


@functools.lru_cache(maxsize=None)
def _compute_ops(p: int, rank: int, m: int, v: int) -> tuple:
    return tuple((op.kind, op.chunk) for group in compute_order(p, rank, m, v) for op in group)


def peak_activation_bytes(pipeline_model_parallel_size: int, pipeline_rank: int, num_microbatches: int,
                          chunk_bytes: tuple, backward_extra: tuple | None = None) -> float:
    """Most activation bytes the rank holds at once: every (micro-batch, chunk) forwarded and not
    yet backwarded, each worth ``chunk_bytes[chunk]``, plus ``backward_extra[chunk]`` while that
    chunk's backward runs (what recomputation rebuilds)."""
    p, v = pipeline_model_parallel_size, len(chunk_bytes)
    extra = backward_extra or (0.0,) * v
    alive = peak = 0.0
    for kind, chunk in _compute_ops(p, pipeline_rank, table_microbatches(num_microbatches, p), v):
        if kind == OpKind.FORWARD:
            alive += chunk_bytes[chunk]
            peak = max(peak, alive)
        else:
            peak = max(peak, alive + extra[chunk])
            alive -= chunk_bytes[chunk]
    return peak
