"""Run every rank's schedule table together on paper: message matching, deadlocks, timing.

Point-to-point messages between two ranks are matched in the order they are
posted (NCCL and gloo both do this), so the k-th send from rank a to rank b must
be the same activation or gradient as the k-th receive on b from a; a table that
breaks this would silently hand a stage the wrong tensor. ``match_messages``
checks it.

``simulate`` then plays the tables with a fixed cost per forward and backward
and free, rendezvous-style communication (a message moves once both ends have
posted it; a communication step ends when all its messages have moved). A table
that can deadlock stops the simulation with an error; one that cannot yields the
per-rank busy intervals, from which the bubble fraction follows.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.pipeline_parallel.schedule_table import OpKind, ScheduleOp, peer, steps

_RECV_FOR_SEND = {OpKind.SEND_FORWARD: OpKind.RECV_FORWARD, OpKind.SEND_BACKWARD: OpKind.RECV_BACKWARD}


class ScheduleError(RuntimeError):
    """A schedule table is inconsistent across ranks or would deadlock."""


def match_messages(table: list[list[ScheduleOp]]) -> dict:
    """Map (rank, op index) of every communication op to its message id (src, dst, k)."""
    p = len(table)
    message_of, sends, recvs = {}, {}, {}
    for rank, ops in enumerate(table):
        for index, op in enumerate(ops):
            if op.is_compute:
                continue
            other, other_chunk = peer(op, p, rank)
            sending = op.kind in _RECV_FOR_SEND
            pair = (rank, other) if sending else (other, rank)
            queue = (sends if sending else recvs).setdefault(pair, [])
            # What the message carries, described the same way from both ends.
            carried = (_RECV_FOR_SEND[op.kind], op.microbatch, other, other_chunk) if sending else \
                (op.kind, op.microbatch, rank, op.chunk)
            message_of[(rank, index)] = (*pair, len(queue))
            queue.append(carried)
    for pair in set(sends) | set(recvs):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        if sent != received:
            first = next((k for k, (s, q) in enumerate(zip(sent, received)) if s != q), min(len(sent), len(received)))
            raise ScheduleError(
                f"messages from pipeline rank {pair[0]} to {pair[1]} do not line up at message {first}: sent "
                f"{sent[first:first + 1]} vs received {received[first:first + 1]} "
                f"({len(sent)} sent, {len(received)} received)")
    return message_of


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    op: ScheduleOp


@dataclass
class Timeline:
    """Busy intervals of every rank; ``forward_time``/``backward_time`` are for a whole stage."""

    intervals: list  # per rank: list[Interval], compute only
    num_microbatches: int
    num_model_chunks: int
    forward_time: float
    backward_time: float

    @property
    def makespan(self) -> float:
        return max((iv[-1].end for iv in self.intervals if iv), default=0.0)

    @property
    def ideal_time(self) -> float:
        """One rank's own work: what the iteration would take with no bubble."""
        has_backward = any(i.op.kind == OpKind.BACKWARD for iv in self.intervals for i in iv)
        return self.num_microbatches * (self.forward_time + (self.backward_time if has_backward else 0.0))

    @property
    def bubble_fraction(self) -> float:
        """Idle time over ideal time, the paper's definition: (p-1)/m for 1F1B."""
        return self.makespan / self.ideal_time - 1.0


def _steps_with_indices(ops: list[ScheduleOp]) -> list[tuple]:
    """``steps(ops)``, each with the indices of its ops in ``ops`` (how ``match_messages`` names them)."""
    index, plan = 0, []
    for step in steps(ops):
        size = 1 if isinstance(step, ScheduleOp) else len(step)
        plan.append((step, list(range(index, index + size))))
        index += size
    return plan


def simulate(table: list[list[ScheduleOp]], forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Play all ranks' tables; a chunk's forward costs ``forward_time / v``, its backward ``backward_time / v``."""
    p = len(table)
    v = 1 + max((op.chunk for ops in table for op in ops), default=0)
    m = 1 + max((op.microbatch for ops in table for op in ops), default=0)
    message_of = match_messages(table)
    rank_steps = [_steps_with_indices(ops) for ops in table]
    cost = {OpKind.FORWARD: forward_time / v, OpKind.BACKWARD: backward_time / v}
    posted: dict = {}  # (message, 'send'|'recv') -> time the end was posted
    clock, position, entered = [0.0] * p, [0] * p, [False] * p
    intervals: list = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while position[rank] < len(rank_steps[rank]):
                step, indices = rank_steps[rank][position[rank]]
                if isinstance(step, ScheduleOp):
                    end = clock[rank] + cost[step.kind]
                    intervals[rank].append(Interval(clock[rank], end, step))
                    clock[rank], position[rank], progress = end, position[rank] + 1, True
                    continue
                ends = [(message_of[(rank, i)], "send" if op.kind in _RECV_FOR_SEND else "recv")
                        for op, i in zip(step, indices)]
                if not entered[rank]:
                    for end_key in ends:
                        posted[end_key] = clock[rank]
                    entered[rank], progress = True, True
                partners = [(message, "recv" if side == "send" else "send") for message, side in ends]
                if not all(key in posted for key in partners):
                    break
                clock[rank] = max([clock[rank]] + [posted[key] for key in partners])
                position[rank], entered[rank], progress = position[rank] + 1, False, True
    stuck = [r for r in range(p) if position[r] < len(rank_steps[r])]
    if stuck:
        waits = {r: [str(op) for op in rank_steps[r][position[r]][0]] for r in stuck}
        raise ScheduleError(f"schedule deadlocks: ranks wait forever on {waits}")
    return Timeline(intervals, m, v, forward_time, backward_time)
