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

--data-parallel-sharding-strategy says what is sharded (ZeRO stages 0-3); each level is one
class in ``sharding_strategy.py``, which this wrapper hands every decision a level changes: what
the buffers store, what a gradient hook does, what runs before a forward and after the step.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.distributed.fully_sharded import FullyShardedUnits
from megatron_lite.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron_lite.distributed.sharding_strategy import sharding_strategy


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
        self.sharding = sharding_strategy(config, data_parallel_group)
        self.is_last_microbatch = True

        params = [p for p in module.parameters() if p.requires_grad]
        units = FullyShardedUnits.units_of(module, fsdp_unit_modules)
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
                group, grad_dtype=torch.float32 if fp32_grads else dtype, sharding=self.sharding,
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
        self.sharding.register_forward_hooks(module, units, self.param_to_bucket)

    @property
    def buckets(self) -> list:
        return [bucket for buffer in self.grad_buffers for bucket in buffer.buckets]

    def param_slices(self) -> list:
        """This rank's ``ParamSlice``s: the elements of each parameter it updates, and where their
        weights and averaged gradients live (its shards when sharded, whole parameters otherwise)."""
        return [s for buffer in self.grad_buffers for s in buffer.param_slices()]

    def parameter_tensors(self) -> list:
        """The tensors holding this chunk's parameters (for measuring memory): the parameters themselves
        (views of the flat buffer under optim and optim_grads) and whatever else the strategy keeps."""
        return list(self.module.parameters()) + self.sharding.parameter_tensors(self.grad_buffers)

    def gradient_tensors(self) -> list:
        """The gradient buffers: full, or ZeRO-2/3's shards and bucket-sized staging buffers."""
        return self.sharding.gradient_tensors(self.grad_buffers)

    @property
    def fully_sharded(self):
        """ZeRO-3's gather schedule (``fully_sharded.py``); None under the other strategies."""
        return self.sharding.fully_sharded

    @property
    def peak_gathered_bytes(self) -> int:
        """ZeRO-3: the most whole-parameter bytes alive at once since ``reset_peak_memory()``."""
        return self.sharding.peak_gathered_bytes

    def reset_peak_memory(self) -> None:
        self.sharding.reset_peak_memory()

    def forward(self, *args, **kwargs):
        return self.sharding.forward(self.module, *args, **kwargs)

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        # Accumulate into the buffer (fp32 for mixed precision), or stage it for ZeRO-2/3's
        # reduce-scatter, and free the model-precision gradient right away.
        bucket = self.param_to_bucket[param]
        self.sharding.add_grad(bucket, param, param.grad)
        param.grad = None
        self.sharding.grad_ready(bucket, param, last_microbatch=self.is_last_microbatch)

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
                self.sharding.start_grad_sync(bucket, async_op=self.config.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction: afterwards each ``ParamSlice.grad`` holds the dp-averaged
        gradient (``main_grad`` for no_shard and optim, where only this rank's shard is averaged
        under optim)."""
        self.start_grad_sync()
        for bucket in self.buckets:
            self.sharding.finish_grad_sync(bucket)
            self.sharding.after_grad_sync(bucket)

    def scale_gradients(self, factor) -> None:
        """Multiply every gradient this rank keeps (full buffers, or ZeRO-2/3's shards, which may live in
        host memory) by ``factor``, a number or a 0-dim tensor."""
        for buffer in self.grad_buffers:
            data = self.sharding.kept_gradients(buffer)
            data.mul_(factor.to(data.device) if torch.is_tensor(factor) else factor)

    def start_param_sync(self) -> None:
        """All-gather the updated parameter shards (optim, optim_grads); asynchronous under
        --overlap-param-gather, the next forward waiting bucket by bucket. ZeRO-3 gathers on use."""
        self.sharding.start_param_sync(self.buckets)

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (before reading or saving weights)."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def gathered_parameters(self, write_back: bool = False):
        """ZeRO-3: every parameter whole inside the block (a collective: every data-parallel rank
        enters it), for ``state_dict()`` and ``load_state_dict()`` (tests and tools; checkpoints read and
        write the shards instead, gathering nothing); with ``write_back`` the values it leaves are kept
        (each rank copies its own shard, no communication). It holds the whole chunk at once. Other
        strategies hold whole parameters already: nothing happens."""
        return self.sharding.gathered_parameters(self.buckets, write_back)

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers; call before each iteration's first micro-batch."""
        for buffer in self.grad_buffers:
            buffer.zero_grad()

    def state_dict(self, *args, **kwargs):
        # Checkpoint names stay the bare module's, identical with or without the wrapper.
        with self.gathered_parameters():
            return self.sharding.state_to_keep(self.module.state_dict(*args, **kwargs))

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
