"""Stand-in NCCL groups: check on CPU that no collective would hand NCCL a host tensor.

NCCL communicates only tensors on the GPU. The CPU tests run gloo, which takes tensors
on any device, so a tensor left on the host (a gradient norm summed next to gradients
that --optimizer-cpu-offload keeps in host memory, say) passes every gloo test and fails
on the first GPU run.

Inside ``nccl_stand_in()``, a ``StandInNcclGroup`` is a one-rank NCCL group to
``megatron_lite.process_groups.collectives``, with the meta device playing the GPU:
``reduction_device`` answers meta for it, and every collective on it raises
``NcclDeviceError``, as NCCL does, when handed a tensor anywhere else. Over one rank a
collective leaves its tensor as it is, so the code under test runs on; ``.item()`` of a
meta tensor reads 0 (values are not what these tests check, devices are).

    group = StandInNcclGroup("model")
    parallel_state.groups["model"] = group
    with nccl_stand_in():
        optimizer.step()
    assert group.calls == [("all_reduce", "meta"), ...]
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.process_groups import collectives

GPU = torch.device("meta")


class NcclDeviceError(RuntimeError):
    pass


class StandInNcclGroup:
    """One rank, NCCL's device rule; ``calls`` records (operation, device type) of every collective."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, str]] = []

    def communicate(self, op: str, *tensors: torch.Tensor) -> None:
        self.calls.append((op, tensors[0].device.type))
        for tensor in tensors:
            if tensor.device != GPU:
                raise NcclDeviceError(f"{op} over the NCCL group {self.name!r} was handed a tensor on "
                                      f"{tensor.device}: NCCL communicates GPU tensors only")


class _Done:
    """The handle of an asynchronous collective that has already completed."""

    def wait(self) -> None:
        pass


def _stand_in(group) -> bool:
    return isinstance(group, StandInNcclGroup)


class _MetaScalarsReadAsZero(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def nccl_stand_in():
    """Within it, StandInNcclGroup objects act as NCCL groups whose GPU is the meta device."""
    backend, world_size, rank = dist.get_backend, dist.get_world_size, dist.get_rank
    all_reduce, broadcast = dist.all_reduce, dist.broadcast
    all_gather, reduce_scatter = collectives._all_gather_single, collectives._reduce_scatter_single

    def one_rank_copy(real, op):
        def call(output, tensor, *args, group=None, async_op=False, **kwargs):
            if not _stand_in(group):
                return real(output, tensor, *args, group=group, async_op=async_op, **kwargs)
            group.communicate(op, output, tensor)
            output.copy_(tensor)
            return _Done() if async_op else None
        return call

    def in_place(real, op):
        def call(tensor, *args, group=None, async_op=False, **kwargs):
            if not _stand_in(group):
                return real(tensor, *args, group=group, async_op=async_op, **kwargs)
            group.communicate(op, tensor)
            return _Done() if async_op else None
        return call

    with pytest.MonkeyPatch.context() as patch, _MetaScalarsReadAsZero():
        patch.setattr(dist, "get_backend", lambda group=None: "nccl" if _stand_in(group) else backend(group))
        patch.setattr(dist, "get_world_size", lambda group=None: 1 if _stand_in(group) else world_size(group))
        patch.setattr(dist, "get_rank", lambda group=None: 0 if _stand_in(group) else rank(group))
        patch.setattr(dist, "all_reduce", in_place(all_reduce, "all_reduce"))
        patch.setattr(dist, "broadcast", in_place(broadcast, "broadcast"))
        patch.setattr(collectives, "_all_gather_single", one_rank_copy(all_gather, "all_gather"))
        patch.setattr(collectives, "_reduce_scatter_single", one_rank_copy(reduce_scatter, "reduce_scatter"))
        patch.setattr(collectives, "_nccl_device", lambda: GPU)
        yield
