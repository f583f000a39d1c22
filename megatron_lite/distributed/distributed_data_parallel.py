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

Expert weights of a mixture-of-experts layer (``param.expert_parallel``) are replicated over another
group, the expert-data-parallel one: they get buffers of their own with a strategy instance over that
group, and each bucket is reduced (and sharded) by its own buffer's strategy.
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
from megatron_lite.process_groups import collectives

DENSE_GROUP = object()  # expert_data_parallel_group's default: experts are reduced with the other weights


class DistributedDataParallel(torch.nn.Module):
    """Wraps one model chunk; its forward is the module's.

    Args:
        module: the model chunk (parameters already on their device and dtype).
        config: the parallel configuration (bucket size, overlap flags, distributed optimizer).
        data_parallel_group: the group gradients are averaged over (None = one rank).
        expert_data_parallel_group: the group expert weights' gradients are summed over, each scaled by one
            over the data-parallel size (default: the data-parallel group, the same average).
        grad_reduce_in_fp32: keep and reduce gradients in fp32. Default: on for bf16 parameters
            (Megatron accumulates bf16 gradients in fp32 unless --grad-reduce-in-bf16) or with
            --accumulate-allreduce-grads-in-fp32; off otherwise (fp16 gradients stay fp16).
        fsdp_unit_modules: module classes ZeRO-3 gathers one instance at a time (``fully_sharded.py``).
    """

    def __init__(self, module: torch.nn.Module, *, config: ParallelConfig, data_parallel_group,
                 expert_data_parallel_group=DENSE_GROUP, grad_reduce_in_fp32: Optional[bool] = None,
                 fsdp_unit_modules: tuple = ()) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.data_parallel_group = data_parallel_group
        if config.ddp_bucket_size is not None and config.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be a positive number of elements, got {config.ddp_bucket_size}.")
        self.sharding = sharding_strategy(config, data_parallel_group)
        if expert_data_parallel_group is DENSE_GROUP:
            expert_data_parallel_group = data_parallel_group
        self.expert_sharding = sharding_strategy(config, expert_data_parallel_group,
                                                 1.0 / collectives.world_size(data_parallel_group))
        self.is_last_microbatch = True

        params = [p for p in module.parameters() if p.requires_grad]
        units = FullyShardedUnits.units_of(module, fsdp_unit_modules)
        by_kind: dict = {}  # (dtype, expert weight?) -> parameters
        for param in params:
            by_kind.setdefault((param.dtype, getattr(param, "expert_parallel", False)), []).append(param)
        self.grad_buffers: list[ParamAndGradBuffer] = []
        for (dtype, expert), group in by_kind.items():
            fp32_grads = grad_reduce_in_fp32
            if fp32_grads is None:
                fp32_grads = config.accumulate_allreduce_grads_in_fp32 or (
                    dtype == torch.bfloat16 and not config.grad_reduce_in_bf16)
            self.grad_buffers.append(ParamAndGradBuffer(
                group, grad_dtype=torch.float32 if fp32_grads else dtype,
                sharding=self.expert_sharding if expert else self.sharding, unit_of=lambda p: units.get(p),
                grad_device=torch.device("cpu") if config.grad_cpu_offload else None))
        self.param_to_bucket = {p: b for buf in self.grad_buffers for p, b in buf.param_to_bucket.items()}
        self.sharding_of = {b: buf.sharding for buf in self.grad_buffers for b in buf.buckets}

        # The hook holds the wrapper weakly: a parameter's hooks live in autograd's C++ side, where the garbage
        # collector cannot see the cycle param -> hook -> wrapper -> param. Held strongly, the wrapper, its
        # buffers and its process groups outlived the run; gloo's threads then ran into interpreter shutdown,
        # which aborted finished runs ("terminate called without an active exception").
        grad_hook = _weak_hook(self._grad_hook)
        for param in params:
            param.register_post_accumulate_grad_hook(grad_hook)
        for sharding in self._shardings():
            sharding.register_forward_hooks(module, units, {p: b for p, b in self.param_to_bucket.items()
                                                            if self.sharding_of[b] is sharding})

    def _shardings(self) -> list:
        """The strategy of the dense weights, then the experts' (when the chunk has experts)."""
        experts = any(buffer.sharding is self.expert_sharding for buffer in self.grad_buffers)
        return [self.sharding] + [self.expert_sharding] * experts

    def _buckets_of(self, sharding) -> list:
        return [b for b in self.buckets if self.sharding_of[b] is sharding]

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
        return list(self.module.parameters()) + [t for buffer in self.grad_buffers
                                                 for t in buffer.sharding.parameter_tensors([buffer])]

    def gradient_tensors(self) -> list:
        """The gradient buffers: full, or ZeRO-2/3's shards and bucket-sized staging buffers."""
        return [t for buffer in self.grad_buffers for t in buffer.sharding.gradient_tensors([buffer])]

    @property
    def fully_sharded(self):
        """ZeRO-3's gather schedule of the dense weights (``fully_sharded.py``); None under the other strategies."""
        return self.sharding.fully_sharded

    @property
    def peak_gathered_bytes(self) -> int:
        """ZeRO-3: the most whole-parameter bytes alive at once since ``reset_peak_memory()`` (dense weights and
        experts measured apart and added: at most that)."""
        return sum(sharding.peak_gathered_bytes for sharding in self._shardings())

    def reset_peak_memory(self) -> None:
        for sharding in self._shardings():
            sharding.reset_peak_memory()

    def forward(self, *args, **kwargs):
        return self.sharding.forward(self.module, *args, **kwargs)

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        # Accumulate into the buffer (fp32 for mixed precision), or stage it for ZeRO-2/3's
        # reduce-scatter, and free the model-precision gradient right away.
        bucket = self.param_to_bucket[param]
        sharding = self.sharding_of[bucket]
        sharding.add_grad(bucket, param, param.grad)
        param.grad = None
        sharding.grad_ready(bucket, param, last_microbatch=self.is_last_microbatch)

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
                self.sharding_of[bucket].start_grad_sync(bucket, async_op=self.config.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction: afterwards each ``ParamSlice.grad`` holds the dp-averaged
        gradient (``main_grad`` for no_shard and optim, where only this rank's shard is averaged
        under optim)."""
        self.start_grad_sync()
        for bucket in self.buckets:
            self.sharding_of[bucket].finish_grad_sync(bucket)
            self.sharding_of[bucket].after_grad_sync(bucket)

    def scale_gradients(self, factor) -> None:
        """Multiply every gradient this rank keeps (full buffers, or ZeRO-2/3's shards, which may live in
        host memory) by ``factor``, a number or a 0-dim tensor."""
        for buffer in self.grad_buffers:
            data = buffer.sharding.kept_gradients(buffer)
            data.mul_(factor.to(data.device) if torch.is_tensor(factor) else factor)

    def start_param_sync(self) -> None:
        """All-gather the updated parameter shards (optim, optim_grads); asynchronous under
        --overlap-param-gather, the next forward waiting bucket by bucket. ZeRO-3 gathers on use."""
        for sharding in self._shardings():
            sharding.start_param_sync(self._buckets_of(sharding))

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
        with contextlib.ExitStack() as stack:
            for sharding in self._shardings():
                stack.enter_context(sharding.gathered_parameters(self._buckets_of(sharding), write_back))
            yield

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
