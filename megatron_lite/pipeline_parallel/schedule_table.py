"""Pipeline schedules as data: what each rank does, in order, as a plain list.

A schedule is built here, in pure Python, before any tensor moves: one list of
``ScheduleOp`` per pipeline rank. ``schedules.py`` executes a rank's list;
``timeline.py`` simulates all of them together; tests check them without any
process group; ``tools/print_pipeline_schedule.py`` prints them.

Notation: p pipeline ranks, m micro-batches, v model chunks per rank (v > 1 is
the interleaved schedule). Chunk c on rank r is *virtual stage* ``c * p + r``:
activations flow rank 0 -> 1 -> ... -> p-1 and then wrap around to rank 0's
next chunk, so every rank holds every p-th slice of the model.

Communication is placed next to the compute that needs it: a receive right
before the forward/backward that consumes it, a send right after the one that
produced it (the interleaved steady state treats a forward and the backward
after it as one unit, see ``compute_order``). Consecutive communication ops form
one *step* that is posted together and waited on together (Megatron's batched
``send_forward_recv_backward`` and friends), which is what keeps neighbours
from each blocking on a send.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Union


class OpKind(Enum):
    """What one op of a rank's table does (``torch.distributed.pipelining``'s ``_ComputationType``);
    the value is its short name in printed tables."""

    FORWARD = "F"
    BACKWARD = "B"
    RECV_FORWARD = "rF"  # activation from the previous virtual stage
    SEND_FORWARD = "sF"  # activation to the next virtual stage
    RECV_BACKWARD = "rB"  # gradient of our output, from the next virtual stage
    SEND_BACKWARD = "sB"  # gradient of our input, to the previous virtual stage

    @property
    def is_compute(self) -> bool:
        return self in (OpKind.FORWARD, OpKind.BACKWARD)


@dataclass(frozen=True)
class ScheduleOp:
    """One step of one rank: ``kind`` applied to ``microbatch`` on model chunk ``chunk``."""

    kind: OpKind
    microbatch: int
    chunk: int = 0

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}.{self.chunk}"


def check_interleaved_microbatches(num_microbatches: int, pipeline_model_parallel_size: int) -> None:
    """Megatron's interleaved schedule walks micro-batches in groups of p (the flags that set the count are
    checked by ``ParallelConfig.check_interleaved_microbatches``)."""
    if num_microbatches % pipeline_model_parallel_size != 0:
        raise ValueError(f"the interleaved schedule runs micro-batches in groups of one per pipeline stage: "
                         f"{num_microbatches} micro-batches is not a multiple of {pipeline_model_parallel_size} "
                         f"stages.")


def num_warmup_microbatches(pipeline_model_parallel_size: int, pipeline_rank: int, num_microbatches: int,
                            num_model_chunks: int = 1) -> int:
    """Forwards a rank runs before its first backward.

    1F1B: the later a stage, the sooner its first backward can arrive, so stage r
    needs ``p - r - 1`` forwards in flight to keep busy. Interleaved: the first
    backward needs one micro-batch through all v*p virtual stages, so every rank
    also runs the (v-1)*p forwards of its earlier chunks, and the p - r - 1 term
    doubles because each hop between ranks now costs a chunk's forward *and* its
    backward worth of waiting (Narayanan et al. 2021).
    """
    p, r, m, v = pipeline_model_parallel_size, pipeline_rank, num_microbatches, num_model_chunks
    if v == 1:
        return min(p - r - 1, m)
    if m == p:
        # One group of micro-batches: there is no steady state to enter, and
        # pairing its first backward with a forward deadlocks (timeline.simulate
        # finds the cycle), so Megatron runs all forwards, then all backwards.
        return m * v
    return min((p - r - 1) * 2 + (v - 1) * p, m * v)


def in_flight_bound(pipeline_model_parallel_size: int, pipeline_rank: int, num_microbatches: int,
                    num_model_chunks: int = 1) -> int:
    """Most (micro-batch, chunk) activations a rank ever holds: warm-up + the steady state's one.

    For 1F1B this is ``min(p - r, m)``: the bound that makes 1F1B's activation
    memory independent of m, unlike GPipe's m.
    """
    warmup = num_warmup_microbatches(pipeline_model_parallel_size, pipeline_rank, num_microbatches,
                                     num_model_chunks)
    total = num_microbatches * num_model_chunks
    return warmup + 1 if warmup < total else total


def _interleaved_position(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """The k-th forward (or backward) of a rank in the interleaved schedule -> (micro-batch, chunk).

    Micro-batches go in groups of p: the group's p micro-batches through chunk 0,
    then the same p through chunk 1, ... Backwards walk the chunks in reverse.
    """
    in_group = k % (p * v)
    chunk = in_group // p
    if not forward:
        chunk = v - 1 - chunk
    return (k // (p * v)) * p + in_group % p, chunk


def compute_order(pipeline_model_parallel_size: int, pipeline_rank: int, num_microbatches: int,
                  num_model_chunks: int = 1, forward_only: bool = False) -> list[tuple[ScheduleOp, ...]]:
    """The forwards and backwards of one rank, in order, grouped into back-to-back runs.

    p = 1 is plain gradient accumulation: forward then backward of each
    micro-batch. Otherwise warm-up forwards, a steady state of one forward then
    one backward, and a cool-down of the remaining backwards (1F1B); with v > 1
    each "micro-batch" step is one (micro-batch, chunk) pair (interleaved 1F1B).
    ``forward_only`` (evaluation) keeps the same forward order with no backwards.

    Communication goes between groups, never inside one. 1F1B groups are single
    ops, so a forward's output leaves before the backward that follows it. The
    interleaved steady state groups each forward with its backward and exchanges
    all four tensors afterwards (Megatron does the same): the ring wrap-around
    from the last rank to the first otherwise closes a cycle of ranks each
    waiting for the other's send (``timeline.simulate`` finds it).
    """
    p, r, m, v = pipeline_model_parallel_size, pipeline_rank, num_microbatches, num_model_chunks
    if v > 1:
        check_interleaved_microbatches(m, p)

    def forward(k: int) -> ScheduleOp:
        return ScheduleOp(OpKind.FORWARD, *_interleaved_position(k, p, v, forward=True))

    def backward(k: int) -> ScheduleOp:
        return ScheduleOp(OpKind.BACKWARD, *_interleaved_position(k, p, v, forward=False))

    total = m * v
    if forward_only:
        return [(forward(k),) for k in range(total)]
    if p == 1:
        return [(ScheduleOp(kind, i),) for i in range(m) for kind in (OpKind.FORWARD, OpKind.BACKWARD)]
    warmup = num_warmup_microbatches(p, r, m, v)
    groups = [(forward(k),) for k in range(warmup)]
    for k in range(total - warmup):
        pair = (forward(warmup + k), backward(k))
        groups += [pair] if v > 1 else [(op,) for op in pair]
    groups += [(backward(k),) for k in range(total - warmup, total)]
    return groups


def is_first_virtual_stage(pipeline_rank: int, chunk: int) -> bool:
    return pipeline_rank == 0 and chunk == 0


def is_last_virtual_stage(pipeline_rank: int, chunk: int, pipeline_model_parallel_size: int,
                          num_model_chunks: int) -> bool:
    return pipeline_rank == pipeline_model_parallel_size - 1 and chunk == num_model_chunks - 1


def add_communication(groups: list[tuple[ScheduleOp, ...]], pipeline_model_parallel_size: int,
                      pipeline_rank: int, num_model_chunks: int = 1) -> list[ScheduleOp]:
    """Put each group's receives right before it and its sends right after it."""
    p, r, v = pipeline_model_parallel_size, pipeline_rank, num_model_chunks
    ops = []
    for group in groups:
        receives, sends = [], []
        for op in group:
            first = is_first_virtual_stage(r, op.chunk)
            last = is_last_virtual_stage(r, op.chunk, p, v)
            if op.kind == OpKind.FORWARD:
                receive, send = (None if first else OpKind.RECV_FORWARD), (None if last else OpKind.SEND_FORWARD)
            else:
                receive, send = (None if last else OpKind.RECV_BACKWARD), (None if first else OpKind.SEND_BACKWARD)
            receives += [ScheduleOp(receive, op.microbatch, op.chunk)] if receive else []
            sends += [ScheduleOp(send, op.microbatch, op.chunk)] if send else []
        ops += receives + list(group) + sends
    return ops


def rank_schedule(pipeline_model_parallel_size: int, pipeline_rank: int, num_microbatches: int,
                  num_model_chunks: int = 1, forward_only: bool = False) -> list[ScheduleOp]:
    """One rank's op list: what ``schedules.ScheduleExecutor`` runs."""
    if num_microbatches < 1:
        raise ValueError(f"a schedule needs at least one micro-batch, got {num_microbatches}.")
    if num_model_chunks > 1 and pipeline_model_parallel_size == 1:
        raise ValueError(f"{num_model_chunks} model chunks per rank interleave over pipeline stages, but the "
                         f"pipeline has one stage.")
    groups = compute_order(pipeline_model_parallel_size, pipeline_rank, num_microbatches, num_model_chunks,
                           forward_only)
    return add_communication(groups, pipeline_model_parallel_size, pipeline_rank, num_model_chunks)


def build_schedule(pipeline_model_parallel_size: int, num_microbatches: int, num_model_chunks: int = 1,
                   forward_only: bool = False) -> list[list[ScheduleOp]]:
    """Every rank's op list: ``table[rank]``."""
    return [rank_schedule(pipeline_model_parallel_size, r, num_microbatches, num_model_chunks, forward_only)
            for r in range(pipeline_model_parallel_size)]


Step = Union[ScheduleOp, tuple]


def steps(ops: list[ScheduleOp]) -> Iterator[Step]:
    """Yield compute ops one at a time and runs of consecutive communication ops as one tuple."""
    pending: list[ScheduleOp] = []
    for op in ops:
        if op.is_compute:
            if pending:
                yield tuple(pending)
                pending = []
            yield op
        else:
            pending.append(op)
    if pending:
        yield tuple(pending)


def peak_in_flight(ops: list[ScheduleOp]) -> int:
    """Most (micro-batch, chunk) pairs forwarded but not yet backwarded at any point of a rank's list."""
    alive = peak = 0
    for op in ops:
        if op.kind == OpKind.FORWARD:
            alive += 1
            peak = max(peak, alive)
        elif op.kind == OpKind.BACKWARD:
            alive -= 1
    return peak


def peer(op: ScheduleOp, pipeline_model_parallel_size: int, pipeline_rank: int) -> tuple[int, int]:
    """(pipeline rank, chunk) at the other end of a communication op."""
    p, r = pipeline_model_parallel_size, pipeline_rank
    downstream = op.kind in (OpKind.SEND_FORWARD, OpKind.RECV_BACKWARD)
    if downstream:
        return (r + 1) % p, op.chunk + (1 if r == p - 1 else 0)
    return (r - 1) % p, op.chunk - (1 if r == 0 else 0)
