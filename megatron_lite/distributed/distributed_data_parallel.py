"""Data parallelism: average gradients over replicas, bucket by bucket.

Each parameter gets ``param.main_grad``, a view into a flat buffer, and a hook
that adds every freshly computed ``param.grad`` into it (then drops ``.grad``),
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
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron_lite.process_groups import collectives
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.distributed.param_and_grad_buffer import ParamAndGradBuffer


def default_bucket_size(config: ParallelConfig, data_parallel_size: int) -> Optional[int]:
    """Megatron's rule: explicit --ddp-bucket-size, else 40M elements (at least 1M per rank)
    when overlapping, else one bucket (nothing to overlap with)."""
    if config.ddp_bucket_size is not None:
        return config.ddp_bucket_size
    if config.overlap_grad_reduce or config.overlap_param_gather:
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
        calculate_per_token_loss: sum gradients over replicas instead of averaging them; the
            per-token loss divides them by the global token count afterwards (finalize_model_grads).
    """

    def __init__(self, module: torch.nn.Module, *, config: ParallelConfig, data_parallel_group,
                 grad_reduce_in_fp32: Optional[bool] = None, calculate_per_token_loss: bool = False) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.data_parallel_group = data_parallel_group
        if config.ddp_bucket_size is not None and config.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be a positive number of elements, got {config.ddp_bucket_size}.")
        data_parallel_size = collectives.world_size(data_parallel_group)
        self.bucket_size = default_bucket_size(config, data_parallel_size)
        gradient_scaling_factor = 1.0 if calculate_per_token_loss else 1.0 / data_parallel_size
        self.is_last_microbatch = True

        params = [p for p in module.parameters() if p.requires_grad]
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
                group, grad_dtype=torch.float32 if fp32_grads else dtype, bucket_size=self.bucket_size,
                gradient_scaling_factor=gradient_scaling_factor,
                data_parallel_group=data_parallel_group, sharded=config.use_distributed_optimizer,
                needs_own_bucket=lambda p: config.use_distributed_optimizer and getattr(p, "shared_embedding", False)))
        self.param_to_bucket = {p: b for buf in self.grad_buffers for p, b in buf.param_to_bucket.items()}

        for param in params:
            param.register_post_accumulate_grad_hook(self._grad_hook)
        if config.overlap_param_gather:
            for submodule in module.modules():
                if any(True for _ in submodule.parameters(recurse=False)):
                    submodule.register_forward_pre_hook(self._param_gather_pre_hook)

    @property
    def buckets(self) -> list:
        return [bucket for buffer in self.grad_buffers for bucket in buffer.buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        # Accumulate into the buffer (fp32 for mixed precision) and free the
        # model-precision gradient right away.
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.config.overlap_grad_reduce and self.is_last_microbatch:
            bucket = self.param_to_bucket[param]
            if bucket.register_grad_ready(param):
                bucket.start_grad_sync(async_op=True)

    def _param_gather_pre_hook(self, module: torch.nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            if param in self.param_to_bucket:
                self.param_to_bucket[param].finish_param_sync()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all micro-batches but the last)."""
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
        """Complete every bucket's reduction: afterwards ``main_grad`` holds the dp-averaged
        gradient (only this rank's shard of it under the distributed optimizer)."""
        self.start_grad_sync()
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def start_param_sync(self) -> None:
        """All-gather the updated parameter shards (distributed optimizer only); asynchronous
        under --overlap-param-gather, the next forward waiting bucket by bucket."""
        # Last bucket first: it holds the first layers, which the next forward needs first.
        for bucket in reversed(self.buckets):
            bucket.start_param_sync(async_op=self.config.overlap_param_gather)

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (before reading or saving weights)."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient in the buffers (the per-token loss's division by the token count)."""
        for buffer in self.grad_buffers:
            buffer.grad_data.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers; call before each iteration's first micro-batch."""
        for buffer in self.grad_buffers:
            buffer.zero_grad()

    def state_dict(self, *args, **kwargs):
        # Checkpoint names stay the bare module's, identical with or without the wrapper.
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
