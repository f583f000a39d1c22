"""Flat gradient (and parameter) buffers cut into buckets.

Every parameter's gradient lives in one contiguous tensor per dtype, so a whole
bucket of gradients is reduced by a single collective instead of one per
parameter. Parameters are laid out in *reverse* order of ``module.parameters()``:
backward produces gradients roughly last layer first, so the first bucket fills
first and its reduction overlaps the rest of the backward pass.

Under every sharding strategy but ``no_shard`` each bucket is padded to a multiple
of the data-parallel size and split into equal shards, rank ``r`` owning shard ``r``
of every bucket. A parameter never spans two buckets (Megatron's rule), but it may
span two ranks' shards. What a rank keeps, and which collective runs when, is its
sharding strategy's (``sharding_strategy.py``): the buffer and its buckets hold the
storage the strategy allocates and the state of each bucket's collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from megatron_lite.process_groups import collectives

if TYPE_CHECKING:  # the strategies build buffers, so a runtime import would be a cycle
    from megatron_lite.distributed.sharding_strategy import StagingPool


@dataclass(eq=False)
class ParamSlice:
    """Elements [start, end) of the flattened parameter ``param`` that this rank updates (all of them
    unless the optimizer state is sharded), and where their weights and their data-parallel averaged
    gradient (after ``finish_grad_sync``) live, as 1-D views.

    ``shape`` is the parameter's whole shape: under ZeRO-3 the parameter itself is empty between uses.
    """

    param: torch.nn.Parameter
    shape: torch.Size
    start: int
    end: int
    data: torch.Tensor
    grad: torch.Tensor


@dataclass(eq=False)
class ParamAndGradBucket:
    """Parameters whose gradients are reduced (and, when sharded, gathered) together.

    ``offset``/``numel`` locate the bucket in its buffer; ``numel`` includes the
    padding that makes it divisible by the data-parallel size when sharded.
    Exactly one of ``grad_data`` (the bucket's part of a full gradient buffer) and
    ``grad_shard`` (this rank's shard of the averaged gradient, ZeRO-2/3) is set; at
    most one of ``param_data`` (full flat parameters, ZeRO-1/2) and ``param_shard``
    (ZeRO-3).
    """

    params: list
    offset: int
    numel: int
    data_parallel_group: object
    layout: dict  # param -> (its first element within the bucket, its shape)
    grad_data: Optional[torch.Tensor] = None
    grad_shard: Optional[torch.Tensor] = None
    param_data: Optional[torch.Tensor] = None
    param_shard: Optional[torch.Tensor] = None
    staging_pool: Optional[StagingPool] = None  # ZeRO-2/3's, shared by the buffer's buckets
    params_with_grad: set = field(default_factory=set)
    grad_handle: object = None
    grad_sync_started: bool = False
    staging: Optional[torch.Tensor] = None
    param_handle: object = None
    gathered: Optional[torch.Tensor] = None  # ZeRO-3: the full parameters while in use
    params_point_at_gathered: bool = False

    def shard(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/dp of a bucket-sized tensor."""
        size = self.numel // collectives.world_size(self.data_parallel_group)
        start = collectives.rank(self.data_parallel_group) * size
        return data[start:start + size]

    def view(self, data: torch.Tensor, param) -> torch.Tensor:
        """``param``'s elements of a bucket-sized tensor, in its shape."""
        start, shape = self.layout[param]
        return data[start:start + shape.numel()].view(shape)

    # Gradients: the strategy adds and reduces them; the bucket keeps count.
    def register_grad_ready(self, param) -> bool:
        """Note that ``param``'s gradient is final; True when the whole bucket is."""
        if param in self.params_with_grad:
            raise RuntimeError(
                "a parameter's gradient was produced twice before finish_grad_sync(): run every "
                "micro-batch but the last inside DistributedDataParallel.no_sync().")
        self.params_with_grad.add(param)
        return len(self.params_with_grad) == len(self.params)

    def reset_grad_sync(self) -> None:
        self.params_with_grad.clear()
        self.grad_handle = None
        self.grad_sync_started = False

    # Parameters.
    def start_param_sync(self, async_op: bool) -> None:
        """All-gather the updated shards so every rank holds the full parameters again (ZeRO-1/2)."""
        if collectives.world_size(self.data_parallel_group) == 1:
            return
        self.param_handle = collectives.all_gather_into_tensor(
            self.param_data, self.shard(self.param_data), self.data_parallel_group, async_op=async_op)

    def finish_param_sync(self) -> None:
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None

    def gather_params(self, async_op: bool) -> None:
        """ZeRO-3: start all-gathering this bucket's parameters (nothing if gathered or on the way)."""
        if self.gathered is not None:
            return
        self.gathered = torch.empty(self.numel, dtype=self.param_shard.dtype, device=self.param_shard.device)
        self.param_handle = collectives.all_gather_into_tensor(self.gathered, self.param_shard,
                                                               self.data_parallel_group, async_op=async_op)

    def wait_params(self) -> None:
        """ZeRO-3: finish the gather and point every parameter at its full values."""
        self.gather_params(async_op=False)
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None
        if not self.params_point_at_gathered:
            for param in self.params:
                param.data = self.view(self.gathered, param)
            self.params_point_at_gathered = True

    def release_params(self) -> None:
        """ZeRO-3: drop the full parameters; each becomes an empty tensor until gathered again."""
        self.finish_param_sync()
        empty = torch.empty(0, dtype=self.param_shard.dtype, device=self.param_shard.device)
        for param in self.params:
            param.data = empty
        self.gathered = None
        self.params_point_at_gathered = False

    def write_back_params(self) -> None:
        """ZeRO-3: copy this rank's shard of the gathered parameters (changed in place) into its storage."""
        self.param_shard.copy_(self.shard(self.gathered))


def plan_buckets(ordered: list, bucket_size: Optional[int], pad_to: int,
                 needs_own_bucket: Callable[[torch.nn.Parameter], bool],
                 unit_of: Callable[[torch.nn.Parameter], object] = lambda param: None) -> list[tuple[int, int, int]]:
    """Bucket boundaries over ``ordered``: (first param index, last param index + 1, padded numel).

    A bucket closes once it holds ``bucket_size`` elements, around a parameter that needs its own,
    and where ``unit_of`` changes (ZeRO-3 gathers whole buckets, one unit's parameters at a time).
    """
    plans, start, numel = [], 0, 0
    for i, param in enumerate(ordered):
        new_unit = i > start and unit_of(param) != unit_of(ordered[i - 1])
        if (needs_own_bucket(param) or new_unit) and i > start:
            plans.append((start, i, numel))
            start, numel = i, 0
        numel += param.numel()
        if (bucket_size is not None and numel >= bucket_size) or needs_own_bucket(param):
            plans.append((start, i + 1, numel))
            start, numel = i + 1, 0
    if start < len(ordered):
        plans.append((start, len(ordered), numel))
    return [(a, b, -(-n // pad_to) * pad_to) for a, b, n in plans]


def _part(storage: Optional[torch.Tensor], window: slice) -> Optional[torch.Tensor]:
    """A bucket's window of one of the buffer's storages (None where its strategy keeps no such storage)."""
    return None if storage is None else storage[window]


class ParamAndGradBuffer:
    """The gradient (and parameter) storage of the params of one dtype, cut into buckets.

    Args:
        params: parameters sharing ``param_dtype``, in ``module.parameters()`` order.
        grad_dtype: dtype of the gradient buffer (fp32 for mixed-precision main grads).
        sharding: the sharding strategy (``sharding_strategy.py``): it plans the buckets, allocates
            the storage and owns the data-parallel group.
        unit_of: ZeRO-3's gather unit of each param (params of different units never share a bucket there).
        grad_device: where gradient shards live (the host under --grad-cpu-offload); default the params'.
    """

    def __init__(self, params: list, *, grad_dtype: torch.dtype, sharding,
                 unit_of: Callable[[torch.nn.Parameter], object] = lambda p: None,
                 grad_device: Optional[torch.device] = None) -> None:
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.sharding = sharding
        self.data_parallel_group = sharding.data_parallel_group
        ordered = list(reversed(params))
        plans = sharding.bucket_plan(ordered, unit_of)

        # What the strategy keeps (None where it keeps no such thing): a full gradient buffer or a
        # shard of it and a staging pool; a flat parameter buffer or a shard of it.
        self.grad_data: Optional[torch.Tensor] = None
        self.grad_shard_data: Optional[torch.Tensor] = None
        self.staging_pool = None
        self.param_data: Optional[torch.Tensor] = None
        self.param_shard_data: Optional[torch.Tensor] = None
        sharding.allocate(self, sum(n for _, _, n in plans), max(n for _, _, n in plans), params[0].device,
                          grad_device)
        self.param_index_map: dict = {}  # param -> (start, end) in the buffer
        self.param_to_bucket: dict = {}
        self.buckets: list[ParamAndGradBucket] = []
        offset = 0
        for first, last, padded in plans:
            bucket = self._bucket(ordered[first:last], offset, padded)
            self.buckets.append(bucket)
            offset += padded

    def _bucket(self, params: list, offset: int, numel: int) -> ParamAndGradBucket:
        shards = self.sharding.num_shards
        window = slice(offset, offset + numel)
        shard_window = slice(offset // shards, (offset + numel) // shards)
        bucket = ParamAndGradBucket(
            params=params, offset=offset, numel=numel, data_parallel_group=self.data_parallel_group,
            layout={}, staging_pool=self.staging_pool,
            grad_data=_part(self.grad_data, window), grad_shard=_part(self.grad_shard_data, shard_window),
            param_data=_part(self.param_data, window), param_shard=_part(self.param_shard_data, shard_window))
        cursor = 0
        for param in params:
            bucket.layout[param] = (cursor, param.shape)
            self.param_index_map[param] = (offset + cursor, offset + cursor + param.numel())
            self.param_to_bucket[param] = bucket
            cursor += param.numel()
        self.sharding.attach(bucket)
        return bucket

    @property
    def padding(self) -> int:
        """Elements added to make buckets divisible by the data-parallel size."""
        total = sum(b.numel for b in self.buckets)
        return total - sum(end - start for start, end in self.param_index_map.values())

    def param_slices(self) -> list[ParamSlice]:
        """This rank's elements of every parameter: its shard of each bucket (all of it unsharded)."""
        slices = []
        for bucket in self.buckets:
            shard = bucket.numel // self.sharding.num_shards
            first = bucket.offset + self.sharding.shard_rank * shard
            window = (first, first + shard)
            for param in bucket.params:
                start, end = self.param_index_map[param]
                lo, hi = max(start, window[0]), min(end, window[1])
                if lo < hi:
                    slices.append(self._slice(bucket, param, lo - start, hi - start, lo - window[0]))
        return slices

    def _slice(self, bucket: ParamAndGradBucket, param, start: int, end: int, in_shard: int) -> ParamSlice:
        """``in_shard``: where element ``start`` sits in this rank's shard of ``bucket``."""
        return ParamSlice(param, bucket.layout[param][1], start, end,
                          self.sharding.slice_data(bucket, param, start, end, in_shard),
                          self.sharding.slice_grad(bucket, param, start, end, in_shard))

    def zero_grad(self) -> None:
        self.sharding.kept_gradients(self).zero_()
        for bucket in self.buckets:
            bucket.reset_grad_sync()
