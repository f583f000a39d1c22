"""Data parallelism: average gradients over replicas, bucket by bucket.

Each parameter gets ``param.main_grad``, a view into a flat buffer (ZeRO-2/3 below
keep no full buffer), and a hook that adds every freshly computed ``param.grad`` into it
(then drops ``.grad``),
so gradient accumulation over micro-batches happens in the buffer's dtype (fp32
for mixed precision). Reductions happen only on the last micro-batch: inside
``no_sync()`` nothing is communicated. With ``--overlap-grad-reduce`` a bucket is
reduced asynchronously as soon as its last gradient arrives, hiding
communication behind the rest of the backward pass.

Under the distributed optimizer the reduction is a reduce-scatter (each rank
keeps the averaged gradient of its own shard only) and, after the optimizer
step, ``start_param_sync()`` all-gathers the updated shards; with
``--overlap-param-gather`` that gather is asynchronous and each module's forward
pre-hook waits only for the buckets holding its own parameters.

--data-parallel-sharding-strategy (ZeRO stage in brackets) says what is sharded:

    no_shard (0)            nothing: gradients all-reduced
    optim (1)               optimizer state (--use-distributed-optimizer)
    optim_grads (2)         + gradients: there is no full gradient buffer, so a bucket is reduce-scattered
                            in *every* micro-batch, as soon as its last gradient arrives (``no_sync``
                            defers nothing); asynchronously with --overlap-grad-reduce, else at once
    optim_grads_params (3)  + parameters: ``fully_sharded.py`` gathers each unit's parameters for its
                            forward and backward; ``state_dict()`` gathers (every rank must call it)
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

from megatron_lite.process_groups import collectives
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.distributed.fully_sharded import FullyShardedUnits
from megatron_lite.distributed.param_and_grad_buffer import ParamAndGradBuffer


def default_bucket_size(config: ParallelConfig, data_parallel_size: int) -> Optional[int]:
    """Megatron's rule: explicit --ddp-bucket-size, else 40M elements (at least 1M per rank)
    when overlapping, else one bucket (nothing to overlap with). ZeRO-2/3 always bucket: their
    staging buffer is a bucket, and one bucket would be the whole model's gradients again."""
    if config.ddp_bucket_size is not None:
        return config.ddp_bucket_size
    if config.overlap_grad_reduce or config.overlap_param_gather or config.shards_gradients:
        return max(40_000_000, 1_000_000 * data_parallel_size)
    return None


class DistributedDataParallel(torch.nn.Module):
    """Wraps one model chunk; its forward is the module's.

    Args:
        module: the model chunk (parameters already on their device and dtype).
        config: the parallel configuration (bucket size, overlap flags, distributed optimizer).
        data_parallel_group: the group gradients are averaged over (None = one rank).
        grad_reduce_in_fp32: keep and reduce gradients in fp32. Default: on for bf16 parameters
            (Megatron accumulates bf16 gradients in fp32 unless --grad-reduce-in-bf16) or with
            --accumulate-allreduce-grads-in-fp32; off otherwise (fp16 gradients stay fp16).
        fsdp_unit_modules: module classes ZeRO-3 gathers one instance at a time (``fully_sharded.py``).
    """

    def __init__(self, module: torch.nn.Module, *, config: ParallelConfig, data_parallel_group,
                 grad_reduce_in_fp32: Optional[bool] = None, fsdp_unit_modules: tuple = ()) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.data_parallel_group = data_parallel_group
        if config.ddp_bucket_size is not None and config.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be a positive number of elements, got {config.ddp_bucket_size}.")
        self.bucket_size = default_bucket_size(config, collectives.world_size(data_parallel_group))
        self.is_last_microbatch = True

        params = [p for p in module.parameters() if p.requires_grad]
        units = FullyShardedUnits.units_of(module, fsdp_unit_modules) if config.shards_parameters else {}
        by_dtype: dict = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        self.grad_buffers: list[ParamAndGradBuffer] = []
        for dtype, group in by_dtype.items():
            fp32_grads = grad_reduce_in_fp32
            if fp32_grads is None:
                fp32_grads = config.accumulate_allreduce_grads_in_fp32 or (
                    dtype == torch.bfloat16 and not config.grad_reduce_in_bf16)
            self.grad_buffers.append(ParamAndGradBuffer(
                group, grad_dtype=torch.float32 if fp32_grads else dtype,
                # ZeRO-3 gathers a bucket at a time: a bucket is a unit (the bucket size does not apply).
                bucket_size=None if config.shards_parameters else self.bucket_size,
                data_parallel_group=data_parallel_group, strategy=config.data_parallel_sharding_strategy,
                overlap_grad_reduce=config.overlap_grad_reduce,
                needs_own_bucket=lambda p: config.use_distributed_optimizer and getattr(p, "shared_embedding", False),
                unit_of=lambda p: units.get(p),
                grad_device=torch.device("cpu") if config.grad_cpu_offload else None))
        self.param_to_bucket = {p: b for buf in self.grad_buffers for p, b in buf.param_to_bucket.items()}

        # The hook holds the wrapper weakly: a parameter's hooks live in autograd's C++ side, where the garbage
        # collector cannot see the cycle param -> hook -> wrapper -> param. Held strongly, the wrapper, its
        # buffers and its process groups outlived the run; gloo's threads then ran into interpreter shutdown,
        # which aborted finished runs ("terminate called without an active exception").
        grad_hook = _weak_hook(self._grad_hook)
        for param in params:
            param.register_post_accumulate_grad_hook(grad_hook)
        self.fully_sharded = (FullyShardedUnits(module, units, self.param_to_bucket,
                                                prefetch=config.overlap_param_gather)
                              if config.shards_parameters else None)
        if config.overlap_param_gather and not config.shards_parameters:
            for submodule in module.modules():
                if any(True for _ in submodule.parameters(recurse=False)):
                    submodule.register_forward_pre_hook(self._param_gather_pre_hook)

    @property
    def buckets(self) -> list:
        return [bucket for buffer in self.grad_buffers for bucket in buffer.buckets]

    def param_slices(self) -> list:
        """This rank's ``ParamSlice``s: the elements of each parameter it updates, and where their
        weights and averaged gradients live (its shards when sharded, whole parameters otherwise)."""
        return [s for buffer in self.grad_buffers for s in buffer.param_slices()]

    def parameter_tensors(self) -> list:
        """The tensors holding this chunk's parameters (for measuring memory): the parameters themselves
        (views of the flat buffer under optim and optim_grads) or, under ZeRO-3, the shards and
        whatever is gathered right now."""
        tensors = list(self.module.parameters())
        tensors += [b.param_shard_data for b in self.grad_buffers if b.param_shard_data is not None]
        return tensors + [b.gathered for b in self.buckets if b.gathered is not None]

    def gradient_tensors(self) -> list:
        """The gradient buffers: full, or ZeRO-2/3's shards and bucket-sized staging buffers."""
        tensors = [t for b in self.grad_buffers for t in (b.grad_data, b.grad_shard_data) if t is not None]
        return tensors + [t for b in self.grad_buffers if b.staging_pool is not None for t in b.staging_pool.buffers]

    @property
    def peak_gathered_bytes(self) -> int:
        """ZeRO-3: the most whole-parameter bytes alive at once since ``reset_peak_memory()``."""
        return 0 if self.fully_sharded is None else self.fully_sharded.peak_gathered_bytes

    def reset_peak_memory(self) -> None:
        if self.fully_sharded is not None:
            self.fully_sharded.peak_gathered_bytes = 0

    def forward(self, *args, **kwargs):
        if self.fully_sharded is None:
            return self.module(*args, **kwargs)
        return self.fully_sharded.forward(*args, **kwargs)

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        # Accumulate into the buffer (fp32 for mixed precision), or stage it for ZeRO-2/3's
        # reduce-scatter, and free the model-precision gradient right away.
        bucket = self.param_to_bucket[param]
        bucket.add_grad(param, param.grad)
        param.grad = None
        if self.config.shards_gradients:
            if bucket.register_grad_ready(param):
                bucket.start_grad_sync(async_op=self.config.overlap_grad_reduce)
                if not self.config.overlap_grad_reduce:
                    bucket.finish_grad_sync()
                if self.fully_sharded is not None:
                    bucket.release_params()  # its backward is done: every gradient has arrived
        elif self.config.overlap_grad_reduce and self.is_last_microbatch:
            if bucket.register_grad_ready(param):
                bucket.start_grad_sync(async_op=True)

    def _param_gather_pre_hook(self, module: torch.nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            if param in self.param_to_bucket:
                self.param_to_bucket[param].finish_param_sync()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all micro-batches but the last); ZeRO-2/3,
        which keep no full gradients to accumulate in, reduce-scatter every micro-batch regardless."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not yet launched (asynchronous when overlapping)."""
        for bucket in self.buckets:
            if not bucket.grad_sync_started:
                bucket.start_grad_sync(async_op=self.config.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction: afterwards each ``ParamSlice.grad`` holds the dp-averaged
        gradient (``main_grad`` for no_shard and optim, where only this rank's shard is averaged
        under optim)."""
        self.start_grad_sync()
        for bucket in self.buckets:
            bucket.finish_grad_sync()
            if self.fully_sharded is not None and bucket.gathered is not None:
                bucket.release_params()  # a parameter that got no gradient kept its bucket gathered

    def scale_gradients(self, factor) -> None:
        """Multiply every gradient this rank keeps (full buffers, or ZeRO-2/3's shards, which may live in
        host memory) by ``factor``, a number or a 0-dim tensor."""
        for buffer in self.grad_buffers:
            for data in (buffer.grad_data, buffer.grad_shard_data):
                if data is not None:
                    data.mul_(factor.to(data.device) if torch.is_tensor(factor) else factor)

    def start_param_sync(self) -> None:
        """All-gather the updated parameter shards (optim, optim_grads); asynchronous under
        --overlap-param-gather, the next forward waiting bucket by bucket. ZeRO-3 gathers on use."""
        if self.fully_sharded is not None:
            return
        # Last bucket first: it holds the first layers, which the next forward needs first.
        for bucket in reversed(self.buckets):
            bucket.start_param_sync(async_op=self.config.overlap_param_gather)

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (before reading or saving weights)."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        """ZeRO-3: every parameter whole inside the block (a collective: every data-parallel rank
        enters it), for ``state_dict()`` and ``load_state_dict()`` (tests and tools; checkpoints read and
        write the shards instead, gathering nothing); with ``write_back`` the values it leaves are kept
        (each rank copies its own shard, no communication). It holds the whole chunk at once. Other
        strategies hold whole parameters already: nothing happens."""
        if self.fully_sharded is None:
            yield
            return
        for bucket in self.buckets:
            bucket.gather_params(async_op=False)
            bucket.wait_params()
        try:
            yield
        finally:
            for bucket in self.buckets:
                if write_back:
                    bucket.write_back_params()
                bucket.release_params()

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers; call before each iteration's first micro-batch."""
        for buffer in self.grad_buffers:
            buffer.zero_grad()

    def state_dict(self, *args, **kwargs):
        # Checkpoint names stay the bare module's, identical with or without the wrapper.
        with self.gathered_parameters():
            state = self.module.state_dict(*args, **kwargs)
            if self.fully_sharded is not None:  # the gathered storage is released on the way out
                state = {name: value.clone() for name, value in state.items()}
        return state

    def load_state_dict(self, state_dict, strict: bool = True):
        with self.gathered_parameters(write_back=True):
            return self.module.load_state_dict(state_dict, strict=strict)


def _weak_hook(method):
    """A hook calling the bound ``method`` while its object lives, holding the object only weakly."""
    reference = weakref.WeakMethod(method)

    def hook(*args):
        live = reference()
        if live is not None:
            live(*args)
    return hook
