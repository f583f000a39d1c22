"""Flat gradient (and parameter) buffers cut into buckets.

Every parameter's gradient lives in one contiguous tensor per dtype, so a whole
bucket of gradients is reduced by a single collective instead of one per
parameter. Parameters are laid out in *reverse* order of ``module.parameters()``:
backward produces gradients roughly last layer first, so the first bucket fills
first and its reduction overlaps the rest of the backward pass.

Under every sharding strategy but ``no_shard`` each bucket is padded to a multiple
of the data-parallel size and split into equal shards, rank ``r`` owning shard ``r``
of every bucket. A parameter never spans two buckets (Megatron's rule), but it may
span two ranks' shards. What a rank keeps (--data-parallel-sharding-strategy, the
ZeRO stage in brackets):

    no_shard                full gradients, all-reduced; the module's own parameters
    optim (1)               full gradients, reduce-scattered in place; full parameters in a flat
                            buffer that the all-gather after the optimizer step writes
    optim_grads (2)         a shard-sized gradient buffer: each micro-batch's gradients of a bucket
                            are copied into a bucket-sized *staging* buffer, reduce-scattered, and
                            the shard added into it; the staging buffer goes back to a small pool
    optim_grads_params (3)  as optim_grads, and only a shard of the parameters: ``gather_params``
                            all-gathers a bucket's parameters for use, ``release_params`` frees them
                            (``fully_sharded.py`` decides when)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_lite.process_groups import collectives


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


class StagingPool:
    """Bucket-sized scratch gradients for ZeRO-2/3, reused from bucket to bucket.

    A bucket borrows one when the first gradient of a micro-batch arrives and gives it back
    once its reduce-scatter is finished. When none is free and more than ``max_in_flight``
    buckets are reducing, the oldest is finished first; so with overlap (``max_in_flight`` 1)
    one bucket is in flight while the next fills, two buffers in all. A further buffer is
    allocated only when every buffer belongs to a bucket that is still filling (gradients
    arriving out of bucket order).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, max_in_flight: int) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.max_in_flight = max_in_flight
        # Allocated up front (one filling, max_in_flight reducing), so memory is measured at start-up.
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(1 + max_in_flight)]
        self.free = list(self.buffers)
        self.in_flight: list["ParamAndGradBucket"] = []  # oldest first

    def acquire(self) -> torch.Tensor:
        if not self.free and len(self.in_flight) > self.max_in_flight:
            self.in_flight[0].finish_grad_sync()
        if not self.free:
            buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.buffers.append(buffer)
            self.free.append(buffer)
        return self.free.pop()


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
    sharded: bool = False
    staging_pool: Optional[StagingPool] = None
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

    # Gradients.
    def add_grad(self, param, grad: torch.Tensor) -> None:
        """Take ``param``'s freshly computed gradient (handed over by the data-parallel hook)."""
        if self.grad_shard is None:  # a full buffer accumulates the micro-batches in place
            self.view(self.grad_data, param).add_(grad)
            return
        if param in self.params_with_grad or self.grad_handle is not None:
            # The previous micro-batch's reduction of this bucket is still pending (one of its
            # parameters got no gradient, or the reduce-scatter is in flight): finish it first.
            self.finish_grad_sync()
        if self.staging is None:
            self.staging = self.staging_pool.acquire()[:self.numel]
            self.staging.zero_()  # padding, and parameters that get no gradient, contribute zero
        self.view(self.staging, param).copy_(grad)

    def register_grad_ready(self, param) -> bool:
        """Note that ``param``'s gradient is final; True when the whole bucket is."""
        if param in self.params_with_grad:
            raise RuntimeError(
                "a parameter's gradient was produced twice before finish_grad_sync(): run every "
                "micro-batch but the last inside DistributedDataParallel.no_sync().")
        self.params_with_grad.add(param)
        return len(self.params_with_grad) == len(self.params)

    def start_grad_sync(self, async_op: bool) -> None:
        """Average this bucket's gradients over data-parallel ranks: all-reduce (no_shard),
        reduce-scatter in place (optim), or reduce-scatter of the staged micro-batch (ZeRO-2/3).

        Gradients are scaled by 1/dp *before* the sum so fp16 gradients cannot
        overflow in the reduction (gloo has no AVG either).
        """
        dp = collectives.world_size(self.data_parallel_group)
        self.grad_sync_started = True
        data = self.grad_data if self.grad_shard is None else self.staging
        if data is None or (dp == 1 and self.grad_shard is None):
            return  # nothing staged, or nothing to average (a staged dp=1 gradient still goes to its shard)
        if dp > 1:
            data.mul_(1.0 / dp)
        if self.sharded:
            self.grad_handle = collectives.reduce_scatter_tensor(
                self.shard(data), data, self.data_parallel_group, async_op=async_op)
        else:
            self.grad_handle = collectives.all_reduce(data, self.data_parallel_group, async_op=async_op)
        if self.grad_shard is not None and async_op:
            self.staging_pool.in_flight.append(self)

    def finish_grad_sync(self) -> None:
        if not self.grad_sync_started:
            self.start_grad_sync(async_op=False)
        if self.grad_handle is not None:
            self.grad_handle.wait()
        if self.staging is not None:
            # Accumulate over micro-batches in the shard (on the host under --grad-cpu-offload).
            self.grad_shard.add_(self.shard(self.staging).to(self.grad_shard.device))
            self.staging_pool.free.append(self.staging._base)
            if self in self.staging_pool.in_flight:
                self.staging_pool.in_flight.remove(self)
            self.staging = None
        self.reset_grad_sync()

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


class ParamAndGradBuffer:
    """The gradient (and parameter) storage of the params of one dtype, cut into buckets.

    Args:
        params: parameters sharing ``param_dtype``, in ``module.parameters()`` order.
        grad_dtype: dtype of the gradient buffer (fp32 for mixed-precision main grads).
        bucket_size: elements per bucket (a bucket closes once it reaches this); None = one bucket.
        data_parallel_group: the group gradients are averaged over.
        strategy: --data-parallel-sharding-strategy (see the module docstring).
        needs_own_bucket: params for which a new bucket is started and closed (the shared
            embedding when sharded, so first and last pipeline stages shard it identically and
            can all-reduce its gradient shard between them).
        unit_of: params with different values never share a bucket (ZeRO-3's gather units).
        grad_device: where gradient shards live (the host under --grad-cpu-offload); default the params'.
        overlap_grad_reduce: ZeRO-2/3 let one bucket's reduce-scatter run while the next bucket fills.
    """

    def __init__(self, params: list, *, grad_dtype: torch.dtype, bucket_size: Optional[int],
                 data_parallel_group, strategy: str = "no_shard", overlap_grad_reduce: bool = False,
                 needs_own_bucket: Callable[[torch.nn.Parameter], bool] = lambda p: False,
                 unit_of: Callable[[torch.nn.Parameter], object] = lambda p: None,
                 grad_device: Optional[torch.device] = None) -> None:
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.strategy = strategy
        self.sharded = strategy != "no_shard"
        shards_grads = strategy in ("optim_grads", "optim_grads_params")
        shards_params = strategy == "optim_grads_params"
        dp = collectives.world_size(data_parallel_group)
        ordered = list(reversed(params))
        plans = plan_buckets(ordered, bucket_size, dp if self.sharded else 1, needs_own_bucket, unit_of)

        total = sum(n for _, _, n in plans)
        device = params[0].device
        self.grad_data = None if shards_grads else torch.zeros(total, dtype=grad_dtype, device=device)
        self.grad_shard_data = (torch.zeros(total // dp, dtype=grad_dtype, device=grad_device or device)
                                if shards_grads else None)
        self.staging_pool = (StagingPool(max(n for _, _, n in plans), grad_dtype, device,
                                         max_in_flight=int(overlap_grad_reduce)) if shards_grads else None)
        self.param_data = (torch.zeros(total, dtype=self.param_dtype, device=device)
                           if self.sharded and not shards_params else None)
        self.param_shard_data = (torch.zeros(total // dp, dtype=self.param_dtype, device=device)
                                 if shards_params else None)
        self.param_index_map: dict = {}  # param -> (start, end) in the buffer
        self.param_to_bucket: dict = {}
        self.buckets: list[ParamAndGradBucket] = []
        offset = 0
        for first, last, padded in plans:
            bucket = self._bucket(ordered[first:last], offset, padded)
            self.buckets.append(bucket)
            offset += padded

    def _bucket(self, params: list, offset: int, numel: int) -> ParamAndGradBucket:
        dp = collectives.world_size(self.data_parallel_group)
        window = slice(offset, offset + numel)
        shard_window = slice(offset // dp, (offset + numel) // dp)
        bucket = ParamAndGradBucket(
            params=params, offset=offset, numel=numel, data_parallel_group=self.data_parallel_group,
            layout={}, sharded=self.sharded, staging_pool=self.staging_pool,
            grad_data=None if self.grad_data is None else self.grad_data[window],
            grad_shard=None if self.grad_shard_data is None else self.grad_shard_data[shard_window],
            param_data=None if self.param_data is None else self.param_data[window],
            param_shard=None if self.param_shard_data is None else self.param_shard_data[shard_window])
        cursor = 0
        for param in params:
            bucket.layout[param] = (cursor, param.shape)
            self.param_index_map[param] = (offset + cursor, offset + cursor + param.numel())
            self.param_to_bucket[param] = bucket
            if bucket.grad_data is not None:
                param.main_grad = bucket.view(bucket.grad_data, param)
            if bucket.param_data is not None:
                # The model parameter *becomes* a view of the flat buffer, so the
                # all-gather after the optimizer step updates it in place.
                view = bucket.view(bucket.param_data, param)
                view.copy_(param.data)
                param.data = view
            cursor += param.numel()
        if bucket.param_shard is not None:
            self._keep_shard_only(bucket)
        return bucket

    @staticmethod
    def _keep_shard_only(bucket: ParamAndGradBucket) -> None:
        """ZeRO-3: copy this rank's shard of the bucket's parameters into its storage, free the rest."""
        full = torch.zeros(bucket.numel, dtype=bucket.param_shard.dtype, device=bucket.param_shard.device)
        for param in bucket.params:
            bucket.view(full, param).copy_(param.data)
        bucket.param_shard.copy_(bucket.shard(full))
        bucket.gathered = full
        bucket.release_params()

    @property
    def padding(self) -> int:
        """Elements added to make buckets divisible by the data-parallel size."""
        total = sum(b.numel for b in self.buckets)
        return total - sum(end - start for start, end in self.param_index_map.values())

    def param_slices(self) -> list[ParamSlice]:
        """This rank's elements of every parameter: its shard of each bucket when sharded, else all."""
        slices = []
        for bucket in self.buckets:
            if self.sharded:
                shard = bucket.numel // collectives.world_size(self.data_parallel_group)
                first = bucket.offset + collectives.rank(self.data_parallel_group) * shard
                window = (first, first + shard)
            else:
                window = (bucket.offset, bucket.offset + bucket.numel)
            for param in bucket.params:
                start, end = self.param_index_map[param]
                lo, hi = max(start, window[0]), min(end, window[1])
                if lo < hi:
                    slices.append(self._slice(bucket, param, lo - start, hi - start, lo - window[0]))
        return slices

    def _slice(self, bucket: ParamAndGradBucket, param, start: int, end: int, in_shard: int) -> ParamSlice:
        """``in_shard``: where element ``start`` sits in this rank's shard of ``bucket``."""
        if bucket.param_shard is not None:
            data = bucket.param_shard[in_shard:in_shard + end - start]
        else:
            data = param.detach().view(-1)[start:end]
        if bucket.grad_shard is not None:
            grad = bucket.grad_shard[in_shard:in_shard + end - start]
        else:
            grad = param.main_grad.view(-1)[start:end]
        return ParamSlice(param, bucket.layout[param][1], start, end, data, grad)

    def zero_grad(self) -> None:
        for data in (self.grad_data, self.grad_shard_data):
            if data is not None:
                data.zero_()
        for bucket in self.buckets:
            bucket.reset_grad_sync()
