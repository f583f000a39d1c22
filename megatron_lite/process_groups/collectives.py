"""Every collective megatron_lite issues goes through here, so it can be counted.

A group of ``None`` means a group of one rank: the call is a no-op (and is not
counted), which keeps single-process runs on the same code path as parallel ones.

``count_collectives()`` records calls and bytes per (operation, group name), so
tests assert communication instead of guessing it, and benchmarks report it.
``tracker`` keeps this rank's last collective and the time spent waiting in them:
what a hang report names (``hang_report.py``) and what --log-straggler leaves out of a step.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MockGroup:
    """Stands in for a ProcessGroup when layouts are checked in one process.

    It answers ``world_size`` and ``rank`` (so layers can size their shards for any
    rank of a large layout) but cannot communicate.
    """

    ranks: tuple
    global_rank: Optional[int] = None  # this process's rank, needed only by rank()


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names now warn on every
# call); older versions have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_group_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_active_counters: list["CollectiveCounter"] = []


def register_group_name(group, name: str) -> None:
    """Name a group ('tensor', 'data', 'pipeline', ...) for the counter."""
    if group is not None:
        try:
            _group_names[group] = name
        except TypeError:  # not weak-referenceable (e.g. a mock): counting falls back to 'group'
            pass


def group_name(group) -> str:
    if group is None:  # torch.distributed's default group (point-to-point ops pass None)
        return "world"
    try:
        return _group_names.get(group, "group")
    except TypeError:
        return "group"


@dataclass
class CollectiveCounter:
    """calls[(op, group)] and bytes[(op, group)], bytes being the local tensor's size."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, group, tensor: torch.Tensor) -> None:
        key = (op, group_name(group))
        self.calls[key] += 1
        self.bytes[key] += tensor.numel() * tensor.element_size()

    def count(self, op: str, group: str) -> int:
        return self.calls.get((op, group), 0)

    def total_bytes(self, group: str | None = None) -> int:
        return sum(b for (_, g), b in self.bytes.items() if group is None or g == group)


@contextlib.contextmanager
def count_collectives():
    counter = CollectiveCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)


@dataclass
class LastCollective:
    """A collective this rank issued: its operation, its group's name, its number among this rank's collectives
    and among those of its group (the same number on every member when they are in step), the training iteration
    that issued it, when it began (``time.time()``) and whether it has returned (an asynchronous one returns at
    once; one that failed never does)."""

    op: str
    group: str
    sequence: int
    group_sequence: int
    iteration: Optional[int]
    started: float
    returned: bool = False


class CollectiveTracker:
    """This rank's last collective, and the seconds spent inside them. Plain attribute writes: a collective
    pays two clock reads and a few assignments."""

    def __init__(self):
        self.last: Optional[LastCollective] = None
        self.sequence = 0
        self.group_sequences: dict = defaultdict(int)
        self.seconds_in_collectives = 0.0
        self.iteration: Optional[int] = None  # set by the training loop: where the collectives were issued

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        last = self.last
        last.returned = exc_type is None
        self.seconds_in_collectives += time.time() - last.started

    def issue(self, op: str, group) -> "CollectiveTracker":
        name = group_name(group)
        self.sequence += 1
        self.group_sequences[name] += 1
        self.last = LastCollective(op, name, self.sequence, self.group_sequences[name], self.iteration, time.time())
        return self


tracker = CollectiveTracker()


def _record(op: str, group, tensor: torch.Tensor) -> CollectiveTracker:
    """Count a collective about to be issued (every wrapper issues it inside the context this returns)."""
    if isinstance(group, MockGroup):
        raise RuntimeError(f"{op} on a mocked process group {group.ranks}: mocked groups are for layout and "
                           f"shape bookkeeping only; run communication on real ranks (tests/distributed.py).")
    for counter in _active_counters:
        counter.record(op, group, tensor)
    return tracker.issue(op, group)


def world_size(group) -> int:
    if isinstance(group, MockGroup):
        return len(group.ranks)
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    """This process's rank within ``group``."""
    if isinstance(group, MockGroup):
        if group.global_rank is None:
            raise ValueError("this MockGroup was built without global_rank, so it has no rank of its own.")
        return group.ranks.index(group.global_rank)
    return 0 if group is None else dist.get_rank(group)


def reduction_device(groups) -> torch.device:
    """Where a tensor built to be communicated over ``groups`` must live: the one rule for every caller.

    NCCL communicates only tensors on this process's GPU; gloo takes host tensors. The data a
    small result comes from (a gradient norm, an overflow flag) may live elsewhere, e.g. on the
    host under --optimizer-cpu-offload: callers move the result here rather than keep it with the data.
    """
    if any(group is not None and dist.get_backend(group) == "nccl" for group in groups):
        return _nccl_device()
    return torch.device("cpu")


def _nccl_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group is None:
        return None
    with _record("all_reduce", group, tensor):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's ``tensor`` along dim 0 into ``output``."""
    if group is None:
        output.copy_(tensor)
        return None
    with _record("all_gather", group, tensor):
        return _all_gather_single(output, tensor.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM,
                          async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's dim-0 slice in ``output``."""
    if group is None:
        output.copy_(tensor)
        return None
    with _record("reduce_scatter", group, tensor):
        return _reduce_scatter_single(output, tensor.contiguous(), op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, group, *, output_split_sizes: list[int],
                      input_split_sizes: list[int]):
    """Rank i sends rows ``input_split_sizes[j]`` of ``tensor`` (in order) to rank j and receives
    ``output_split_sizes[j]`` rows from it into ``output``; sizes may differ from rank to rank."""
    if group is None:
        output.copy_(tensor)
        return None
    with _record("all_to_all", group, tensor):
        return dist.all_to_all_single(output, tensor.contiguous(), output_split_sizes, input_split_sizes,
                                      group=group)


def reduce(tensor: torch.Tensor, dst: int, group, op=dist.ReduceOp.SUM):
    """Sum ``tensor`` over ``group`` into rank ``dst``'s (a global rank, as in torch.distributed)."""
    if group is None:
        return None
    with _record("reduce", group, tensor):
        return dist.reduce(tensor, dst=dst, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool = False):
    """``src`` is a global rank, as in torch.distributed."""
    if group is None:
        return None
    with _record("broadcast", group, tensor):
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def batch_isend_irecv(ops: list) -> list:
    """Point-to-point sends and receives (``dist.P2POp``s, each naming its group), issued together
    so neither side blocks first."""
    if not ops:
        return []
    for op in ops:
        _record("send" if op.op in (dist.isend, dist.send) else "recv", op.group, op.tensor)
    with tracker:
        return dist.batch_isend_irecv(ops)
