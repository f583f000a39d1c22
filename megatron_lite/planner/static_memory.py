"""Parameters, gradients and optimizer state per rank, for each data-parallel sharding strategy.

The accounting is the one ``MegatronOptimizer.memory_report()`` measures on a live
run, element for element (a test holds them equal):

- parameters in the model's dtype; gradients in the gradient buffer's dtype (fp32
  for bf16, or with --accumulate-allreduce-grads-in-fp32; else the model's);
- optimizer state in fp32: Adam's two moments (SGD's momentum), plus an fp32 main
  copy of the weights when the model is not fp32 (or lives apart, under offload), plus
  an fp32 main gradient when the gradient buffer is not fp32 (or lives apart).

Per parameter that is REFERENCE.md section 6: 16 bytes for fp32, 18 for bf16 and 20 for
fp16 unsharded; 8 + 8/d, 6 + 12/d and 4 + 16/d with the distributed optimizer.

Sharding (Megatron's ``--data-parallel-sharding-strategy``): buckets of the flat
gradient buffer are padded to a multiple of d and split into d equal shards, rank r
owning shard r, so which elements a rank owns follows the bucket plan exactly.

- ``no_shard``: everything replicated.
- ``optim`` (ZeRO-1, ``--use-distributed-optimizer``): optimizer state for the shard only.
- ``optim_grads`` (ZeRO-2): also gradients: the shard plus one full bucket in flight.
- ``optim_grads_params`` (ZeRO-3): also parameters: the shard plus two whole layers
  gathered (the one computing and the one prefetched).

The last two are the design of the ZeRO-2/3 work, not yet measured against code.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from megatron_lite.config import Config, ConfigError
from megatron_lite.distributed.distributed_data_parallel import default_bucket_size
from megatron_lite.distributed.param_and_grad_buffer import plan_buckets
from megatron_lite.planner.parameters import ParamSpec, chunk_parameters, rank_chunk_shapes

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Megatron's bucket size when overlapping; ZeRO-2/3 always bucket (a single bucket would
# keep the whole gradient in flight and shard nothing).
SHARDED_GRADIENT_BUCKET = 40_000_000


@dataclass(frozen=True)
class StaticMemory:
    """Bytes a rank holds for the whole run, whatever the batch."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer_elements: int  # parameter elements this rank's optimizer updates
    bucket_elements: tuple = ()  # padded size of each gradient bucket (what data parallelism communicates)
    optimizer_state_on_host: bool = False

    @property
    def device_bytes(self) -> int:
        host = self.optimizer_state_on_host
        return self.parameter_bytes + self.gradient_bytes + (0 if host else self.optimizer_state_bytes)


def check_strategy(strategy: str) -> None:
    if strategy not in SHARDING_STRATEGIES:
        raise ConfigError(f"--data-parallel-sharding-strategy must be one of {', '.join(SHARDING_STRATEGIES)}, "
                          f"got {strategy!r}.")


def dtype_bytes(config: Config) -> int:
    return 2 if (config.training.bf16 or config.training.fp16) else 4


def gradient_dtype_bytes(config: Config) -> int:
    """DistributedDataParallel's rule: fp32 buffers for bf16 or when asked, else the model's dtype."""
    fp32 = config.training.bf16 or config.parallel.accumulate_allreduce_grads_in_fp32
    return 4 if fp32 else dtype_bytes(config)


def optimizer_bytes_per_element(config: Config) -> int:
    """fp32 bytes the optimizer keeps per element it owns (see the module docstring)."""
    opt = config.optimizer
    states = 2 if opt.optimizer == "adam" else int(opt.sgd_momentum > 0)
    main_copy = dtype_bytes(config) != 4 or opt.optimizer_cpu_offload
    grad_copy = gradient_dtype_bytes(config) != 4 or opt.optimizer_cpu_offload
    return 4 * (states + main_copy + grad_copy)


@dataclass(frozen=True)
class Bucket:
    real: int  # parameter elements
    padded: int  # with the padding that makes it divisible by the data-parallel size


def buckets(chunk: list[ParamSpec], config: Config, strategy: str, data_parallel_size: int) -> list[Bucket]:
    """The gradient buffer's buckets for one chunk, as DistributedDataParallel builds them."""
    sharded = strategy != "no_shard"
    bucket_size = default_bucket_size(config.parallel, data_parallel_size)
    if strategy in ("optim_grads", "optim_grads_params") and bucket_size is None:
        bucket_size = max(SHARDED_GRADIENT_BUCKET, 1_000_000 * data_parallel_size)
    ordered = list(reversed(chunk))  # backward order: the buffer starts with the last layer
    plans = plan_buckets(ordered, bucket_size, data_parallel_size if sharded else 1,
                         lambda spec: sharded and spec.shared_embedding)
    return [Bucket(sum(s.elements for s in ordered[first:last]), padded) for first, last, padded in plans]


def _owned(bucket: Bucket, data_parallel_size: int, data_parallel_rank: int) -> int:
    """Real elements in rank r's shard: the padding sits at the end of the bucket."""
    shard = bucket.padded // data_parallel_size
    return min(shard, max(0, bucket.real - data_parallel_rank * shard))


def _gathered_units(chunks: list[list[ParamSpec]]) -> list[int]:
    """Element counts of what ZeRO-3 gathers as one piece: each transformer layer, each other parameter."""
    units: dict[str, int] = {}
    for chunk in chunks:
        for spec in chunk:
            key = ".".join(spec.name.split(".")[:3]) if spec.name.startswith("decoder.layers.") else spec.name
            units[key] = units.get(key, 0) + spec.elements
    return sorted(units.values(), reverse=True)


def static_memory(config: Config, strategy: str, *, pipeline_rank: int, data_parallel_size: int,
                  data_parallel_rank: int = 0) -> StaticMemory:
    """What one rank holds: rank (pipeline_rank, data_parallel_rank) of the layout in ``config``."""
    check_strategy(strategy)
    shapes = tuple((len(s.layer_numbers), s.pre_process, s.post_process)
                   for s in rank_chunk_shapes(config, pipeline_rank))
    return _static_memory(_Sizing.of(config), shapes, strategy, data_parallel_size, data_parallel_rank)


@dataclass(frozen=True)
class _Sizing:
    """Everything besides the stage and the sharding that decides a rank's static bytes (hashable, so
    the many layouts of an enumeration that differ only in batch or recomputation share one result)."""

    model: tuple
    config: Config = field(compare=False, hash=False)  # the same sizes whichever config carries them

    @classmethod
    def of(cls, config: Config) -> "_Sizing":
        parallel, optimizer = config.parallel, config.optimizer
        key = (dataclasses.astuple(config.model), parallel.tensor_model_parallel_size, config.training.bf16,
               config.training.fp16, parallel.accumulate_allreduce_grads_in_fp32, parallel.ddp_bucket_size,
               parallel.overlap_grad_reduce, parallel.overlap_param_gather, optimizer.optimizer,
               optimizer.sgd_momentum > 0, optimizer.optimizer_cpu_offload)
        return cls(key, config)


@functools.lru_cache(maxsize=4096)
def _static_memory(sizing: _Sizing, shapes: tuple, strategy: str, data_parallel_size: int,
                   data_parallel_rank: int) -> StaticMemory:
    config, d, r = sizing.config, data_parallel_size, data_parallel_rank
    t = config.parallel.tensor_model_parallel_size
    chunks, first_layer = [], 0
    for layers, pre_process, post_process in shapes:  # sizes do not depend on which layers they are
        chunks.append(chunk_parameters(config.model, tensor_model_parallel_size=t,
                                       layer_numbers=range(first_layer, first_layer + layers),
                                       pre_process=pre_process, post_process=post_process))
        first_layer += layers
    plan = [b for chunk in chunks for b in buckets(chunk, config, strategy, d)]
    real, padded = sum(b.real for b in plan), sum(b.padded for b in plan)
    param_b, grad_b = dtype_bytes(config), gradient_dtype_bytes(config)
    opt_b = optimizer_bytes_per_element(config)
    owned = real if strategy == "no_shard" else sum(_owned(b, d, r) for b in plan)
    parameters, gradients = padded, padded
    if strategy in ("optim_grads", "optim_grads_params"):
        gradients = min(padded, padded // d + max(b.padded for b in plan))
    if strategy == "optim_grads_params":
        parameters = min(padded, padded // d + sum(_gathered_units(chunks)[:2]))
    return StaticMemory(parameter_bytes=parameters * param_b, gradient_bytes=gradients * grad_b,
                        optimizer_state_bytes=owned * opt_b, optimizer_elements=owned,
                        bucket_elements=tuple(b.padded for b in plan),
                        optimizer_state_on_host=config.optimizer.optimizer_cpu_offload)
