"""The ZeRO levels as strategies: what a data-parallel rank stores, and which collective runs when.

``--data-parallel-sharding-strategy`` picks one class (Megatron-LM's values; the ZeRO stage, as
DeepSpeed numbers them, in brackets; PyTorch FSDP's name after it):

    NoShard                 no_shard (0)            NO_SHARD       everything whole; a bucket is all-reduced
                                                                   once per step, on the last micro-batch
    ShardOptimizer          optim (1)                              + optimizer state: a bucket is reduce-scattered
                                                                   in place, the updated shards all-gathered
                                                                   after the optimizer step
    ShardOptimizerAndGrads  optim_grads (2)         SHARD_GRAD_OP  + gradients: each micro-batch's bucket is
                                                                   staged, reduce-scattered, added to a shard
    ShardEverything         optim_grads_params (3)  FULL_SHARD     + parameters: a unit is gathered before its
                                                                   forward and its backward, released after

Each stage is the one before it plus one more thing sharded, so each class overrides only the
methods for that thing. The interface, in the order a step meets it:

    what a rank stores     ``bucket_plan``, ``allocate``, ``attach``, ``slice_data``/``slice_grad``
                           (its ``ParamSlice``s), ``kept_gradients``, ``gradient_tensors``, ``parameter_tensors``
    a gradient arrives     ``add_grad``, then ``grad_ready`` (DistributedDataParallel's hook)
    a bucket is reduced    ``start_grad_sync``, ``finish_grad_sync``, ``after_grad_sync``
    before a forward       ``register_forward_hooks``, ``forward``
    after the step         ``start_param_sync``; ``gathered_parameters`` for whole weights on demand
    what the planner counts  ``stored_parameter_elements``, ``stored_gradient_elements``,
                           ``gathered_elements``, ``step_communication_s``

The buffers and buckets (``param_and_grad_buffer.py``) hold the storage; a strategy decides what
is allocated and which collective runs when. A strategy shards over the data-parallel group it is
built with, so another group (expert data parallelism) gets an instance of its own; the planner
builds one over a ``MockGroup`` of the planned size and counts with the same methods.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.distributed.fully_sharded import FullyShardedUnits
from megatron_lite.distributed.param_and_grad_buffer import plan_buckets
from megatron_lite.process_groups import collectives


class NoShard:
    """ZeRO stage 0: whole parameters, a whole gradient buffer that accumulates the micro-batches in
    place, all-reduced bucket by bucket on the last one (as soon as a bucket is complete under
    --overlap-grad-reduce, else all at the end); the optimizer updates every element.

    Args:
        data_parallel_group: the group gradients are summed over (None = one rank; a ``MockGroup``
            for the planner).
        config: bucket size and overlap flags.
        gradient_scaling_factor: what each gradient is multiplied by before the sum; default one over the
            group's size, an average. Expert weights are summed over the expert-data-parallel group but
            scaled by one over the data-parallel size (Megatron-LM's rule): each expert replica has seen
            the tokens of ``data-parallel size / expert-data-parallel size`` data-parallel replicas.
    """

    name = "no_shard"
    fully_sharded: Optional[FullyShardedUnits] = None  # ZeRO-3's gather schedule; the others keep parameters whole

    def __init__(self, data_parallel_group, config: ParallelConfig,
                 gradient_scaling_factor: Optional[float] = None) -> None:
        self.data_parallel_group = data_parallel_group
        self.data_parallel_size = collectives.world_size(data_parallel_group)
        self.config = config
        self.gradient_scaling_factor = (1.0 / self.data_parallel_size if gradient_scaling_factor is None
                                        else gradient_scaling_factor)

    # What a rank stores.
    @property
    def num_shards(self) -> int:
        """Into how many equal shards each bucket is cut (padded to a multiple of it)."""
        return 1

    @property
    def shard_rank(self) -> int:
        """Which shard of every bucket this rank owns (updates, and keeps when sharded)."""
        return 0

    @property
    def bucket_size(self) -> Optional[int]:
        """Megatron's rule: explicit --ddp-bucket-size, else 40M elements (at least 1M per rank) when
        overlapping, else one bucket (nothing to overlap with)."""
        if self.config.ddp_bucket_size is not None:
            return self.config.ddp_bucket_size
        if self.config.overlap_grad_reduce or self.config.overlap_param_gather:
            return self._overlap_bucket_size()
        return None

    def _overlap_bucket_size(self) -> int:
        return max(40_000_000, 1_000_000 * self.data_parallel_size)

    def needs_own_bucket(self, param) -> bool:
        """Parameters for which a bucket is started and closed."""
        return False

    def bucket_plan(self, ordered: list, unit_of: Callable) -> list[tuple[int, int, int]]:
        """``plan_buckets`` over ``ordered`` (parameters or the planner's ``ParamSpec``s, backward order);
        ``unit_of``: the ZeRO-3 unit of each (only ZeRO-3 cuts buckets by unit)."""
        return plan_buckets(ordered, self.bucket_size, self.num_shards, self.needs_own_bucket)

    def allocate(self, buffer, numel: int, largest_bucket: int, device: torch.device,
                 grad_device: Optional[torch.device]) -> None:
        """Give ``buffer`` its storage for ``numel`` (padded) elements."""
        self._allocate_gradients(buffer, numel, largest_bucket, device, grad_device)
        self._allocate_parameters(buffer, numel, device)

    def _allocate_gradients(self, buffer, numel, largest_bucket, device, grad_device) -> None:
        buffer.grad_data = torch.zeros(numel, dtype=buffer.grad_dtype, device=device)

    def _allocate_parameters(self, buffer, numel, device) -> None:
        pass  # the module's own parameters (no padding)

    def attach(self, bucket) -> None:
        """Point the bucket's parameters at their storage."""
        self._attach_gradients(bucket)
        self._attach_parameters(bucket)

    def _attach_gradients(self, bucket) -> None:
        for param in bucket.params:
            param.main_grad = bucket.view(bucket.grad_data, param)

    def _attach_parameters(self, bucket) -> None:
        pass

    def slice_data(self, bucket, param, start: int, end: int, in_shard: int) -> torch.Tensor:
        """Where this rank keeps elements [start, end) of ``param``'s weights (``in_shard``: where element
        ``start`` sits in its shard of ``bucket``)."""
        return param.detach().view(-1)[start:end]

    def slice_grad(self, bucket, param, start: int, end: int, in_shard: int) -> torch.Tensor:
        """Where the averaged gradient of those elements lands."""
        return param.main_grad.view(-1)[start:end]

    def kept_gradients(self, buffer) -> torch.Tensor:
        """The gradients kept across micro-batches (what is zeroed and scaled)."""
        return buffer.grad_data

    def gradient_tensors(self, buffers: list) -> list:
        """All gradient storage of ``buffers`` (for measuring memory)."""
        return [self.kept_gradients(b) for b in buffers]

    def parameter_tensors(self, buffers: list) -> list:
        """Parameter storage beyond the module's parameters themselves (for measuring memory)."""
        return []

    # A gradient arrives, a bucket is reduced.
    def add_grad(self, bucket, param, grad: torch.Tensor) -> None:
        """Take ``param``'s freshly computed gradient: the full buffer accumulates the micro-batches."""
        bucket.view(bucket.grad_data, param).add_(grad)

    def grad_ready(self, bucket, param, *, last_microbatch: bool) -> None:
        """``param``'s gradient was added: with overlap, reduce its bucket once complete on the last
        micro-batch (inside ``no_sync`` nothing is communicated)."""
        if self.config.overlap_grad_reduce and last_microbatch and bucket.register_grad_ready(param):
            self.start_grad_sync(bucket, async_op=True)

    def start_grad_sync(self, bucket, async_op: bool) -> None:
        """Average the bucket's gradients over the data-parallel group: scaled (by 1/dp) *before* the sum so
        fp16 gradients cannot overflow in the reduction (gloo has no AVG either)."""
        bucket.grad_sync_started = True
        self._scaled(bucket.grad_data)
        if self.data_parallel_size > 1:
            bucket.grad_handle = self._reduce(bucket, bucket.grad_data, async_op)

    def _scaled(self, data: torch.Tensor) -> torch.Tensor:
        if self.gradient_scaling_factor != 1.0:
            data.mul_(self.gradient_scaling_factor)
        return data

    def _reduce(self, bucket, data: torch.Tensor, async_op: bool):
        return collectives.all_reduce(data, self.data_parallel_group, async_op=async_op)

    def finish_grad_sync(self, bucket) -> None:
        """Complete the bucket's reduction (launching it if nobody has)."""
        if not bucket.grad_sync_started:
            self.start_grad_sync(bucket, async_op=False)
        if bucket.grad_handle is not None:
            bucket.grad_handle.wait()
        self._reduced(bucket)
        bucket.reset_grad_sync()

    def _reduced(self, bucket) -> None:
        pass  # the averaged gradients are in place already

    def after_grad_sync(self, bucket) -> None:
        """The step's reduction of ``bucket`` is final (``DistributedDataParallel.finish_grad_sync``)."""

    # Before a forward, after the optimizer step.
    def register_forward_hooks(self, module: torch.nn.Module, units: dict, param_to_bucket: dict) -> None:
        """Hook what must happen before ``module``'s parts run (``units``: parameter -> its ZeRO-3 unit)."""

    def forward(self, module: torch.nn.Module, *args, **kwargs):
        return module(*args, **kwargs)

    def start_param_sync(self, buckets: list) -> None:
        """After the optimizer step: nothing, it wrote the whole parameters already."""

    def gathered_parameters(self, buckets: list, write_back: bool):
        """Every parameter whole inside the block: they are whole already."""
        return contextlib.nullcontext()

    def state_to_keep(self, state: dict) -> dict:
        """A state dict taken inside ``gathered_parameters``, made to outlive the block."""
        return state

    @property
    def peak_gathered_bytes(self) -> int:
        return 0

    def reset_peak_memory(self) -> None:
        pass

    # What the planner counts (elements per rank; ``bucket_sizes``: the padded buckets of one chunk).
    def stored_parameter_elements(self, bucket_sizes: list[int]) -> int:
        return sum(bucket_sizes)

    def stored_gradient_elements(self, bucket_sizes: list[int]) -> tuple[int, int]:
        """(all gradient elements, the part of them in host memory)."""
        return sum(bucket_sizes), 0

    def gathered_elements(self, unit_elements: dict, together: list[set]) -> int:
        """The most parameter elements gathered at once, beyond what is stored (``unit_elements``: unit
        -> its padded elements; ``together``: the sets of units whole at the same time)."""
        return 0

    def step_communication_s(self, *, microbatches: int, all_reduce_s: float, reduce_scatter_s: float,
                             all_gather_s: float, exposed_in_backward: Callable, exposed_in_forward: Callable) -> float:
        """Exposed data-parallel communication per step, given each collective's time over all the buckets
        and ``exposed_in_*(seconds, overlapped)``: what the backward (forward) compute does not hide."""
        return exposed_in_backward(all_reduce_s, self.config.overlap_grad_reduce)


class ShardOptimizer(NoShard):
    """ZeRO stage 1, the distributed optimizer (``--use-distributed-optimizer``): each bucket is padded
    to a multiple of dp and cut into dp shards, rank r updating shard r. Gradients stay whole (a full
    buffer accumulates the micro-batches) and are reduce-scattered in place; parameters live in a flat
    buffer that the all-gather after the optimizer step writes (with --overlap-param-gather
    asynchronously, each module's forward waiting only for the buckets holding its parameters)."""

    name = "optim"

    @property
    def num_shards(self) -> int:
        return self.data_parallel_size

    @property
    def shard_rank(self) -> int:
        return collectives.rank(self.data_parallel_group)

    def needs_own_bucket(self, param) -> bool:
        # The embedding two pipeline stages share: both shard it identically, so they can all-reduce
        # its gradient shard between them.
        return getattr(param, "shared_embedding", False)

    def _allocate_parameters(self, buffer, numel, device) -> None:
        buffer.param_data = torch.zeros(numel, dtype=buffer.param_dtype, device=device)

    def _attach_parameters(self, bucket) -> None:
        for param in bucket.params:
            # The model parameter *becomes* a view of the flat buffer, so the
            # all-gather after the optimizer step updates it in place.
            view = bucket.view(bucket.param_data, param)
            view.copy_(param.data)
            param.data = view

    def _reduce(self, bucket, data: torch.Tensor, async_op: bool):
        return collectives.reduce_scatter_tensor(bucket.shard(data), data, self.data_parallel_group,
                                                 async_op=async_op)

    def register_forward_hooks(self, module: torch.nn.Module, units: dict, param_to_bucket: dict) -> None:
        if not self.config.overlap_param_gather:
            return

        def wait_for_own_parameters(submodule: torch.nn.Module, args) -> None:
            for param in submodule.parameters(recurse=False):
                if param in param_to_bucket:
                    param_to_bucket[param].finish_param_sync()

        for submodule in module.modules():
            if any(True for _ in submodule.parameters(recurse=False)):
                submodule.register_forward_pre_hook(wait_for_own_parameters)

    def start_param_sync(self, buckets: list) -> None:
        """All-gather the updated shards; asynchronous under --overlap-param-gather."""
        # Last bucket first: it holds the first layers, which the next forward needs first.
        for bucket in reversed(buckets):
            bucket.start_param_sync(async_op=self.config.overlap_param_gather)

    def step_communication_s(self, *, microbatches, all_reduce_s, reduce_scatter_s, all_gather_s,
                             exposed_in_backward, exposed_in_forward) -> float:
        return (exposed_in_backward(reduce_scatter_s, self.config.overlap_grad_reduce)
                + exposed_in_forward(all_gather_s, self.config.overlap_param_gather))


class StagingPool:
    """Bucket-sized scratch gradients for ZeRO-2/3, reused from bucket to bucket.

    A bucket borrows one when the first gradient of a micro-batch arrives and gives it back
    once its reduce-scatter is finished. When none is free and more than ``max_in_flight``
    buckets are reducing, the oldest is finished first (``ShardOptimizerAndGrads``); so with
    overlap (``max_in_flight`` 1) one bucket is in flight while the next fills, two buffers in
    all. A further buffer is allocated only when every buffer belongs to a bucket that is still
    filling (gradients arriving out of bucket order).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, max_in_flight: int) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.max_in_flight = max_in_flight
        # Allocated up front (one filling, max_in_flight reducing), so memory is measured at start-up.
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(1 + max_in_flight)]
        self.free = list(self.buffers)
        self.in_flight: list = []  # buckets reducing from one of the buffers, oldest first

    def acquire(self) -> torch.Tensor:
        if not self.free:
            buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.buffers.append(buffer)
            self.free.append(buffer)
        return self.free.pop()


class ShardOptimizerAndGrads(ShardOptimizer):
    """ZeRO stage 2: also the gradients. A rank keeps only its shard of the averaged gradients (in host
    memory under --grad-cpu-offload); with no full buffer to accumulate in, each micro-batch's gradients
    of a bucket are copied into a bucket-sized *staging* buffer, reduce-scattered as soon as the bucket
    is complete (``no_sync`` defers nothing; asynchronously with --overlap-grad-reduce, else at once)
    and the shard added into the kept one; the staging buffer goes back to a small pool."""

    name = "optim_grads"

    @property
    def bucket_size(self) -> Optional[int]:
        # Always bucketed: the staging buffer is a bucket, and one bucket would be the whole model's
        # gradients again.
        if self.config.ddp_bucket_size is not None:
            return self.config.ddp_bucket_size
        return self._overlap_bucket_size()

    def _allocate_gradients(self, buffer, numel, largest_bucket, device, grad_device) -> None:
        buffer.grad_shard_data = torch.zeros(numel // self.num_shards, dtype=buffer.grad_dtype,
                                             device=grad_device or device)
        buffer.staging_pool = StagingPool(largest_bucket, buffer.grad_dtype, device,
                                          max_in_flight=int(self.config.overlap_grad_reduce))

    def _attach_gradients(self, bucket) -> None:
        pass  # no main_grad: gradients go through the staging buffer to the shard

    def slice_grad(self, bucket, param, start, end, in_shard) -> torch.Tensor:
        return bucket.grad_shard[in_shard:in_shard + end - start]

    def kept_gradients(self, buffer) -> torch.Tensor:
        return buffer.grad_shard_data

    def gradient_tensors(self, buffers: list) -> list:
        return super().gradient_tensors(buffers) + [t for b in buffers for t in b.staging_pool.buffers]

    def add_grad(self, bucket, param, grad: torch.Tensor) -> None:
        """Stage ``param``'s gradient for this micro-batch's reduce-scatter of its bucket."""
        if param in bucket.params_with_grad or bucket.grad_handle is not None:
            # The previous micro-batch's reduction of this bucket is still pending (one of its
            # parameters got no gradient, or the reduce-scatter is in flight): finish it first.
            self.finish_grad_sync(bucket)
        if bucket.staging is None:
            bucket.staging = self._staging_buffer(bucket.staging_pool)[:bucket.numel]
            bucket.staging.zero_()  # padding, and parameters that get no gradient, contribute zero
        bucket.view(bucket.staging, param).copy_(grad)

    def _staging_buffer(self, pool: StagingPool) -> torch.Tensor:
        if not pool.free and len(pool.in_flight) > pool.max_in_flight:
            self.finish_grad_sync(pool.in_flight[0])
        return pool.acquire()

    def grad_ready(self, bucket, param, *, last_microbatch: bool) -> None:
        if bucket.register_grad_ready(param):
            self._bucket_complete(bucket)

    def _bucket_complete(self, bucket) -> None:
        """Every gradient of the bucket arrived in this micro-batch: reduce-scatter it now."""
        self.start_grad_sync(bucket, async_op=self.config.overlap_grad_reduce)
        if not self.config.overlap_grad_reduce:
            self.finish_grad_sync(bucket)

    def start_grad_sync(self, bucket, async_op: bool) -> None:
        bucket.grad_sync_started = True
        if bucket.staging is None:
            return  # nothing staged in this micro-batch
        # Even a dp=1 gradient goes through the reduce-scatter, to its shard.
        bucket.grad_handle = self._reduce(bucket, self._scaled(bucket.staging), async_op)
        if async_op:
            bucket.staging_pool.in_flight.append(bucket)

    def _reduced(self, bucket) -> None:
        if bucket.staging is None:
            return
        # Accumulate over micro-batches in the shard (on the host under --grad-cpu-offload).
        bucket.grad_shard.add_(bucket.shard(bucket.staging).to(bucket.grad_shard.device))
        pool = bucket.staging_pool
        pool.free.append(bucket.staging._base)
        if bucket in pool.in_flight:
            pool.in_flight.remove(bucket)
        bucket.staging = None

    def stored_gradient_elements(self, bucket_sizes: list[int]) -> tuple[int, int]:
        # A shard of the averaged gradients, plus the staging pool: one bucket filling and, with
        # --overlap-grad-reduce, one being reduce-scattered.
        shard = sum(bucket_sizes) // self.num_shards
        staging = (1 + self.config.overlap_grad_reduce) * max(bucket_sizes, default=0)
        return shard + staging, shard if self.config.grad_cpu_offload else 0

    def step_communication_s(self, *, microbatches, all_reduce_s, reduce_scatter_s, all_gather_s,
                             exposed_in_backward, exposed_in_forward) -> float:
        # No full gradient buffer to accumulate into: every micro-batch scatters.
        return (microbatches * exposed_in_backward(reduce_scatter_s, self.config.overlap_grad_reduce)
                + exposed_in_forward(all_gather_s, self.config.overlap_param_gather))


class ShardEverything(ShardOptimizerAndGrads):
    """ZeRO stage 3: also the parameters. A rank keeps only its shard of every bucket's parameters;
    ``fully_sharded.py`` gathers each unit's parameters before its forward and its backward and
    releases them after, and a bucket is one unit's parameters (--ddp-bucket-size does not apply).
    Whole weights exist only inside ``gathered_parameters`` (a collective: every rank enters it)."""

    name = "optim_grads_params"

    @property
    def bucket_size(self) -> Optional[int]:
        return None  # a bucket is what one gather brings: a unit, cut by ``bucket_plan``

    def bucket_plan(self, ordered: list, unit_of: Callable) -> list[tuple[int, int, int]]:
        return plan_buckets(ordered, self.bucket_size, self.num_shards, self.needs_own_bucket, unit_of)

    def _allocate_parameters(self, buffer, numel, device) -> None:
        buffer.param_shard_data = torch.zeros(numel // self.num_shards, dtype=buffer.param_dtype, device=device)

    def _attach_parameters(self, bucket) -> None:
        """Copy this rank's shard of the bucket's parameters into its storage, free the rest."""
        full = torch.zeros(bucket.numel, dtype=bucket.param_shard.dtype, device=bucket.param_shard.device)
        for param in bucket.params:
            bucket.view(full, param).copy_(param.data)
        bucket.param_shard.copy_(bucket.shard(full))
        bucket.gathered = full
        bucket.release_params()

    def slice_data(self, bucket, param, start, end, in_shard) -> torch.Tensor:
        return bucket.param_shard[in_shard:in_shard + end - start]

    def parameter_tensors(self, buffers: list) -> list:
        """The shards, and whatever is gathered right now."""
        return ([b.param_shard_data for b in buffers]
                + [bucket.gathered for b in buffers for bucket in b.buckets if bucket.gathered is not None])

    def _bucket_complete(self, bucket) -> None:
        super()._bucket_complete(bucket)
        bucket.release_params()  # its backward is done: every gradient has arrived

    def after_grad_sync(self, bucket) -> None:
        if bucket.gathered is not None:
            bucket.release_params()  # a parameter that got no gradient kept its bucket gathered

    def register_forward_hooks(self, module: torch.nn.Module, units: dict, param_to_bucket: dict) -> None:
        self.fully_sharded = FullyShardedUnits(module, units, param_to_bucket,
                                               prefetch=self.config.overlap_param_gather)

    def forward(self, module: torch.nn.Module, *args, **kwargs):
        return self.fully_sharded.forward(*args, **kwargs)

    def start_param_sync(self, buckets: list) -> None:
        """Nothing: each unit is gathered when it runs."""

    @contextlib.contextmanager
    def gathered_parameters(self, buckets: list, write_back: bool):
        """Gather every bucket; with ``write_back`` keep the values the block leaves (each rank copies
        its own shard, no communication). It holds the whole chunk at once."""
        for bucket in buckets:
            bucket.gather_params(async_op=False)
            bucket.wait_params()
        try:
            yield
        finally:
            for bucket in buckets:
                if write_back:
                    bucket.write_back_params()
                bucket.release_params()

    def state_to_keep(self, state: dict) -> dict:
        return {name: value.clone() for name, value in state.items()}  # the gathered storage is released

    @property
    def peak_gathered_bytes(self) -> int:
        return self.fully_sharded.peak_gathered_bytes

    def reset_peak_memory(self) -> None:
        self.fully_sharded.peak_gathered_bytes = 0

    def stored_parameter_elements(self, bucket_sizes: list[int]) -> int:
        return sum(bucket_sizes) // self.num_shards

    def gathered_elements(self, unit_elements: dict, together: list[set]) -> int:
        return max((sum(unit_elements[u] for u in units) for units in together), default=0)

    def step_communication_s(self, *, microbatches, all_reduce_s, reduce_scatter_s, all_gather_s,
                             exposed_in_backward, exposed_in_forward) -> float:
        # Prefetching the next unit's parameters while this one computes, every forward and backward.
        return microbatches * (exposed_in_forward(all_gather_s, True)
                               + exposed_in_backward(all_gather_s + reduce_scatter_s, True))


STRATEGIES = {strategy.name: strategy for strategy in (NoShard, ShardOptimizer, ShardOptimizerAndGrads,
                                                        ShardEverything)}


def sharding_strategy(config: ParallelConfig, data_parallel_group,
                      gradient_scaling_factor: Optional[float] = None) -> NoShard:
    """The strategy ``config.data_parallel_sharding_strategy`` names, over ``data_parallel_group``."""
    return STRATEGIES[config.data_parallel_sharding_strategy](data_parallel_group, config, gradient_scaling_factor)
