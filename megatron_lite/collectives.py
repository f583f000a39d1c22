"""Every collective megatron_lite issues goes through here, so it can be counted.

A group of ``None`` means a group of one rank: the call is a no-op (and is not
counted), which keeps single-process runs on the same code path as parallel ones.

``count_collectives()`` records calls and bytes per (operation, group name), so
tests assert communication instead of guessing it, and benchmarks report it.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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
    try:
        return _group_names.get(group, "world" if group is None else "group")
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


def _record(op: str, group, tensor: torch.Tensor) -> None:
    for counter in _active_counters:
        counter.record(op, group, tensor)


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group is None:
        return None
    _record("all_reduce", group, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's ``tensor`` along dim 0 into ``output``."""
    if group is None:
        output.copy_(tensor)
        return None
    _record("all_gather", group, tensor)
    return dist.all_gather_into_tensor(output, tensor.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM,
                          async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's dim-0 slice in ``output``."""
    if group is None:
        output.copy_(tensor)
        return None
    _record("reduce_scatter", group, tensor)
    return dist.reduce_scatter_tensor(output, tensor.contiguous(), op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool = False):
    """``src`` is a global rank, as in torch.distributed."""
    if group is None:
        return None
    _record("broadcast", group, tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def batch_isend_irecv(ops: list, group=None) -> list:
    """Point-to-point sends and receives, issued together so neither side blocks first."""
    if not ops:
        return []
    for op in ops:
        _record("send" if op.op in (dist.isend, dist.send) else "recv", op.group, op.tensor)
    return dist.batch_isend_irecv(ops)
