"""Flat gradient (and parameter) buffers cut into buckets.

Every parameter's gradient lives in one contiguous tensor per dtype, so a whole
bucket of gradients is reduced by a single collective instead of one per
parameter. Parameters are laid out in *reverse* order of ``module.parameters()``:
backward produces gradients roughly last layer first, so the first bucket fills
first and its reduction overlaps the rest of the backward pass.

With the distributed optimizer each bucket is padded to a multiple of the
data-parallel size and split into equal shards, rank ``r`` owning shard ``r`` of
every bucket: the gradient reduction becomes a reduce-scatter and the parameters
themselves also live in a flat buffer so the all-gather after the optimizer step
writes straight into them. A parameter never spans two buckets (Megatron's rule),
but it may span two ranks' shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_lite.process_groups import collectives


@dataclass(eq=False)
class ParamAndGradBucket:
    """Parameters whose gradients are reduced (and, when sharded, gathered) together.

    ``offset``/``numel`` locate the bucket in its buffer; ``numel`` includes the
    padding that makes it divisible by the data-parallel size when sharded.
    """

    params: list
    offset: int
    numel: int
    grad_data: torch.Tensor
    param_data: Optional[torch.Tensor]
    data_parallel_group: object
    sharded: bool
    gradient_scaling_factor: float = 1.0
    params_with_grad: set = field(default_factory=set)
    grad_handle: object = None
    grad_sync_started: bool = False
    param_handle: object = None

    def shard(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/dp of a bucket-sized tensor."""
        size = self.numel // collectives.world_size(self.data_parallel_group)
        start = collectives.rank(self.data_parallel_group) * size
        return data[start:start + size]

    def start_grad_sync(self, async_op: bool) -> None:
        """Sum this bucket's gradients over data-parallel ranks, each first multiplied by
        ``gradient_scaling_factor`` (1/dp: the average; 1 under the per-token loss).

        Scaling *before* the sum keeps fp16 gradients from overflowing in the reduction (gloo has
        no AVG either).
        """
        dp = collectives.world_size(self.data_parallel_group)
        self.grad_sync_started = True
        if dp == 1:
            return
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        if self.sharded:
            self.grad_handle = collectives.reduce_scatter_tensor(
                self.shard(self.grad_data), self.grad_data, self.data_parallel_group, async_op=async_op)
        else:
            self.grad_handle = collectives.all_reduce(self.grad_data, self.data_parallel_group, async_op=async_op)

    def finish_grad_sync(self) -> None:
        if not self.grad_sync_started:
            self.start_grad_sync(async_op=False)
        if self.grad_handle is not None:
            self.grad_handle.wait()
        self.reset_grad_sync()

    def reset_grad_sync(self) -> None:
        self.params_with_grad.clear()
        self.grad_handle = None
        self.grad_sync_started = False

    def register_grad_ready(self, param) -> bool:
        """Note that ``param``'s gradient is final; True when the whole bucket is."""
        if param in self.params_with_grad:
            raise RuntimeError(
                "a parameter's gradient was produced twice before finish_grad_sync(): run every "
                "micro-batch but the last inside DistributedDataParallel.no_sync().")
        self.params_with_grad.add(param)
        return len(self.params_with_grad) == len(self.params)

    def start_param_sync(self, async_op: bool) -> None:
        """All-gather the updated shards so every rank holds the full parameters again."""
        if collectives.world_size(self.data_parallel_group) == 1:
            return
        self.param_handle = collectives.all_gather_into_tensor(
            self.param_data, self.shard(self.param_data), self.data_parallel_group, async_op=async_op)

    def finish_param_sync(self) -> None:
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None


def _plan_buckets(ordered: list, bucket_size: Optional[int], pad_to: int,
                  needs_own_bucket: Callable[[torch.nn.Parameter], bool]) -> list[tuple[int, int, int]]:
    """Bucket boundaries over ``ordered``: (first param index, last param index + 1, padded numel)."""
    plans, start, numel = [], 0, 0
    for i, param in enumerate(ordered):
        if needs_own_bucket(param) and i > start:
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
    """One flat gradient buffer (and, when sharded, parameter buffer) for params of one dtype.

    Args:
        params: parameters sharing ``param_dtype``, in ``module.parameters()`` order.
        grad_dtype: dtype of the gradient buffer (fp32 for mixed-precision main grads).
        bucket_size: elements per bucket (a bucket closes once it reaches this); None = one bucket.
        data_parallel_group: the group gradients are averaged over.
        sharded: True for the distributed optimizer (reduce-scatter, parameter buffer, padding).
        needs_own_bucket: params for which a new bucket is started and closed (the shared
            embedding under the distributed optimizer, so first and last pipeline stages shard it
            identically and can all-reduce its gradient shard between them).
        gradient_scaling_factor: each rank's gradients are multiplied by this before the sum (1/dp averages).
    """

    def __init__(self, params: list, *, grad_dtype: torch.dtype, bucket_size: Optional[int],
                 data_parallel_group, sharded: bool,
                 needs_own_bucket: Callable[[torch.nn.Parameter], bool] = lambda p: False,
                 gradient_scaling_factor: Optional[float] = None) -> None:
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.sharded = sharded
        if gradient_scaling_factor is None:
            gradient_scaling_factor = 1.0 / collectives.world_size(data_parallel_group)
        pad_to = collectives.world_size(data_parallel_group) if sharded else 1
        ordered = list(reversed(params))
        plans = _plan_buckets(ordered, bucket_size, pad_to, needs_own_bucket)

        total = sum(n for _, _, n in plans)
        device = params[0].device
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_data = torch.zeros(total, dtype=self.param_dtype, device=device) if sharded else None
        self.param_index_map: dict = {}  # param -> (start, end) in the buffer
        self.param_to_bucket: dict = {}
        self.buckets: list[ParamAndGradBucket] = []
        offset = 0
        for first, last, padded in plans:
            bucket_params, cursor = ordered[first:last], offset
            for param in bucket_params:
                self.param_index_map[param] = (cursor, cursor + param.numel())
                param.main_grad = self.grad_data[cursor:cursor + param.numel()].view(param.shape)
                if sharded:
                    # The model parameter *becomes* a view of the flat buffer, so the
                    # all-gather after the optimizer step updates it in place.
                    view = self.param_data[cursor:cursor + param.numel()].view(param.shape)
                    view.copy_(param.data)
                    param.data = view
                cursor += param.numel()
            bucket = ParamAndGradBucket(
                params=bucket_params, offset=offset, numel=padded,
                grad_data=self.grad_data[offset:offset + padded],
                param_data=self.param_data[offset:offset + padded] if sharded else None,
                data_parallel_group=data_parallel_group, sharded=sharded,
                gradient_scaling_factor=gradient_scaling_factor)
            self.buckets.append(bucket)
            for param in bucket_params:
                self.param_to_bucket[param] = bucket
            offset += padded

    @property
    def padding(self) -> int:
        """Elements added to make buckets divisible by the data-parallel size."""
        return self.grad_data.numel() - sum(end - start for start, end in self.param_index_map.values())

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset_grad_sync()
