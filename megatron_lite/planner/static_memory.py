"""Parameters, gradients and optimizer state per rank, for each data-parallel sharding strategy.

The accounting is the one ``MegatronOptimizer.memory_report()`` measures on a live
run, element for element (a test holds them equal for every strategy):

- parameters in the model's dtype; gradients in the gradient buffer's dtype (fp32
  for bf16, or with --accumulate-allreduce-grads-in-fp32; else the model's);
- optimizer state in fp32: Adam's two moments (SGD's momentum, Lion's one; under Muon one momentum for the
  matrices it orthogonalises and the scalar optimizer's for the rest), plus an fp32 main
  copy of the weights when the model is not fp32 (or lives apart, under offload), plus
  an fp32 main gradient when the gradient buffer is not fp32 (or lives apart: under
  offload, unless --grad-cpu-offload keeps the gradient shards in host memory already).

Per parameter that is docs/reference.md section 6: 16 bytes for fp32, 18 for bf16 and 20 for
fp16 unsharded; 8 + 8/d, 6 + 12/d and 4 + 16/d with the distributed optimizer; 4 + 12/d,
2 + 16/d and 2 + 18/d under ZeRO-2, 16/d, 18/d and 20/d under ZeRO-3, plus what follows.

Buckets are DistributedDataParallel's: --ddp-bucket-size elements, else Megatron's
max(40M, 1M x d) when overlapping or under ZeRO-2, else one bucket per model chunk;
under ZeRO-3 one bucket per *unit* (the embedding, each transformer layer, and the rest:
final norm and output layer), whatever the size. When sharded each bucket is padded to a
multiple of d and split into d equal shards, rank r owning shard r, and the word embedding
that two pipeline stages share gets buckets of its own; so which elements a rank owns
follows the bucket plan exactly (``buckets`` runs the code's own planner). What each strategy
stores is counted by the strategy object training uses (``distributed/sharding_strategy.py``),
built over a mock group of the planned size:

- ``no_shard``: everything replicated; the parameters are the module's own (no padding).
- ``optim`` (ZeRO-1, ``--use-distributed-optimizer``): optimizer state for the shard only;
  parameters and gradients in flat padded buffers.
- ``optim_grads`` (ZeRO-2): also gradients: the shard, plus a pool of bucket-sized staging
  buffers for the micro-batch being reduced: one, two with --overlap-grad-reduce (one
  filling, one in flight); --grad-cpu-offload keeps the shard in host memory.
- ``optim_grads_params`` (ZeRO-3): also parameters: the shard between uses; at its peak
  (``peak_parameter_bytes``, what a device must fit) the shard plus the units whole at once
  (``gathered_together``), taken over the chunk that gathers the most.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from megatron_lite.config import Config
from megatron_lite.distributed.sharding_strategy import NoShard, sharding_strategy
from megatron_lite.planner.parameters import ParamSpec, chunk_parameters, fsdp_unit, rank_chunk_shapes
from megatron_lite.process_groups.collectives import MockGroup


@dataclass(frozen=True)
class StaticMemory:
    """Bytes a rank holds for the whole run, whatever the batch (``memory_report()``'s keys)."""

    parameter_bytes: int  # between uses: whole parameters, or ZeRO-3's shards
    peak_parameter_bytes: int  # with the most ZeRO-3 holds gathered at once (parameter_bytes otherwise)
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer_elements: int  # parameter elements this rank's optimizer updates
    optimizer_matrix_elements: int = 0  # of them, those in weight matrices (what --optimizer muon orthogonalises)
    bucket_elements: tuple = ()  # padded size of each gradient bucket (what data parallelism communicates)
    expert_bucket_elements: tuple = ()  # the experts' buckets (what the expert-data-parallel group communicates)
    host_gradient_bytes: int = 0  # the part of gradient_bytes in host memory (--grad-cpu-offload's shards)
    optimizer_state_on_host: bool = False
    reference_bytes: int = 0  # the frozen reference (--dpo, --grpo): this rank's model shard again (reference_model)
    # --dpo-precompute-ref-log-probs: that reference held only for its pass before training (no activation is kept
    # for a backward then), then freed: not in device_bytes, but in the estimate's peak beside that pass's working
    # memory
    reference_pass_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        optimizer = 0 if self.optimizer_state_on_host else self.optimizer_state_bytes
        return (self.peak_parameter_bytes + self.gradient_bytes - self.host_gradient_bytes + optimizer
                + self.reference_bytes)


def dtype_bytes(config: Config) -> int:
    return 2 if (config.training.bf16 or config.training.fp16) else 4


def gradient_dtype_bytes(config: Config) -> int:
    """DistributedDataParallel's rule: fp32 buffers for bf16 or when asked, else the model's dtype."""
    fp32 = config.training.bf16 or config.parallel.accumulate_allreduce_grads_in_fp32
    return 4 if fp32 else dtype_bytes(config)


def optimizer_state_bytes(config: Config, owned: int, owned_matrices: int) -> int:
    """fp32 bytes the optimizer keeps for the ``owned`` elements it updates, ``owned_matrices`` of them in weight
    matrices (see the module docstring)."""
    opt = config.optimizer
    moments = {"adam": 2, "sgd": int(opt.sgd_momentum > 0), "lion": 1}
    if opt.optimizer == "muon":  # a momentum buffer per matrix element, the scalar optimizer's state elsewhere
        states = owned_matrices + (owned - owned_matrices) * moments[opt.muon_scalar_optimizer]
    else:
        states = owned * moments[opt.optimizer]
    offload = opt.optimizer_cpu_offload
    main_copy = dtype_bytes(config) != 4 or offload
    # Offloaded, the step reads its gradients from host memory: a copy, unless --grad-cpu-offload keeps them there.
    grad_copy = gradient_dtype_bytes(config) != 4 or (offload and not config.parallel.grad_cpu_offload)
    return 4 * (states + owned * (main_copy + grad_copy))


def planned_sharding(config: Config, data_parallel_size: int, data_parallel_rank: int = 0) -> NoShard:
    """The sharding strategy DistributedDataParallel builds for ``config``, on data-parallel rank
    ``data_parallel_rank`` of ``data_parallel_size``."""
    group = MockGroup(ranks=tuple(range(data_parallel_size)), global_rank=data_parallel_rank)
    return sharding_strategy(config.parallel, group)


@dataclass(frozen=True)
class Bucket:
    real: int  # parameter elements
    padded: int  # with the padding that makes it divisible by the data-parallel size
    unit: str  # the unit (``parameters.fsdp_unit``) of its first parameter; under ZeRO-3, of all of them
    matrices: tuple = ()  # (first, end) element of each weight matrix in it (``ParamSpec.matrix``)


def buckets(chunk: list[ParamSpec], config: Config, data_parallel_size: int) -> list[Bucket]:
    """The gradient buffer's buckets for one chunk, as DistributedDataParallel builds them for
    ``config.parallel``'s sharding strategy."""
    ordered = list(reversed(chunk))  # backward order: the buffer starts with the last layer
    plans = planned_sharding(config, data_parallel_size).bucket_plan(ordered, fsdp_unit)
    return [Bucket(sum(s.elements for s in ordered[first:last]), padded, fsdp_unit(ordered[first]),
                   _matrix_spans(ordered[first:last])) for first, last, padded in plans]


def _matrix_spans(specs: list[ParamSpec]) -> tuple:
    """Where the weight matrices lie in a bucket holding ``specs`` one after the other."""
    spans, start = [], 0
    for spec in specs:
        if spec.matrix:
            spans.append((start, start + spec.elements))
        start += spec.elements
    return tuple(spans)


def _owned(bucket: Bucket, num_shards: int, shard_rank: int) -> tuple[int, int]:
    """(real elements, weight-matrix elements) in shard ``shard_rank``: the padding sits at the end of the bucket."""
    shard = bucket.padded // num_shards
    first, end = shard_rank * shard, (shard_rank + 1) * shard
    matrices = sum(max(0, min(end, stop) - max(first, start)) for start, stop in bucket.matrices)
    return min(shard, max(0, bucket.real - first)), matrices


def recompute_groups(config: Config, layers: list[str]) -> list[list[str]]:
    """The layers a chunk recomputes together (one checkpoint each), of its ``layers`` in forward order:
    groups of --recompute-num-layers under full uniform recomputation, else one layer at a time."""
    training = config.training
    size = training.recompute_num_layers or 1
    if training.recompute_granularity != "full" or (training.recompute_method or "uniform") != "uniform":
        size = 1  # block recomputation checkpoints its layers one by one, like no recomputation for this
    return [layers[i:i + size] for i in range(0, len(layers), size)]


def gathered_together(order: list[str], *, prefetch: bool, tied_embedding: bool,
                      groups: list[list[str]]) -> list[set[str]]:
    """The sets of ZeRO-3 units of one chunk whole at the same time, ``order`` its units in forward
    order (``fully_sharded.py``'s schedule). In backward: the running unit and, prefetching, the one
    before it; all the units of a recomputed group, from their recomputed forward to their backward,
    and the one before the group when prefetching. A tied embedding on a one-stage model stays whole
    from the output layer's backward to its own, so through all of these. The forward's sets (the
    running unit and, prefetching, the next; the root with the tied embedding it borrows) are each
    within one of these."""
    group_of = {unit: group for group in groups for unit in group}
    together = []
    for unit in order:
        group = group_of.get(unit, [unit])
        first = order.index(group[0])
        before = [order[first - 1]] if prefetch and first > 0 else []
        together.append({*group, *before, *(["embedding"] if tied_embedding else [])})
    return together


def expert_data_parallel_size(config: Config, data_parallel_size: int) -> int:
    """The replicas of each expert shard: a stage's ranks (tp x dp) over expert-model x expert-tensor ones."""
    parallel = config.parallel
    stage = parallel.tensor_model_parallel_size * data_parallel_size
    return max(1, stage // (parallel.expert_model_parallel_size * parallel.expert_tensor_size))


def static_memory(config: Config, *, pipeline_rank: int, data_parallel_size: int, data_parallel_rank: int = 0,
                  expert_data_parallel_rank: int = 0) -> StaticMemory:
    """What one rank holds: rank (pipeline_rank, data_parallel_rank) of the layout in ``config``, whose expert
    weights (a mixture of experts') are replica ``expert_data_parallel_rank``, under its
    --data-parallel-sharding-strategy; dense weights are sharded over the data-parallel ranks, experts over
    the expert-data-parallel ones, each in buffers of their own (``distributed_data_parallel.py``)."""
    shapes = tuple((s.layer_numbers, s.pre_process, s.post_process) for s in rank_chunk_shapes(config, pipeline_rank))
    return _static_memory(_Sizing.of(config), shapes, data_parallel_size, data_parallel_rank,
                          expert_data_parallel_rank)


@dataclass(frozen=True)
class _Sizing:
    """Everything besides the stage and the data-parallel rank that decides a rank's static bytes
    (hashable, so the many layouts of an enumeration that differ only in batch share one result)."""

    model: tuple
    config: Config = field(compare=False, hash=False)  # the same sizes whichever config carries them

    @classmethod
    def of(cls, config: Config) -> "_Sizing":
        parallel, optimizer, training = config.parallel, config.optimizer, config.training
        key = (_model_key(config.model), parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size,
               parallel.expert_tensor_size, training.bf16, training.fp16,
               parallel.data_parallel_sharding_strategy, parallel.accumulate_allreduce_grads_in_fp32,
               parallel.ddp_bucket_size, parallel.overlap_grad_reduce, parallel.overlap_param_gather,
               parallel.grad_cpu_offload, optimizer.optimizer, optimizer.sgd_momentum > 0,
               optimizer.muon_scalar_optimizer,
               optimizer.optimizer_cpu_offload, training.recompute_granularity, training.recompute_method,
               training.recompute_num_layers, reference_copy(config), training.dpo_precompute_ref_log_probs)
        return cls(key, config)


_MODEL_KEYS: dict = {}  # id(model) -> (model, its key): an enumeration's thousands of layouts share one model


def _model_key(model) -> tuple:
    """The model's fields as a hashable tuple (lists, --window-size's, as tuples), computed once per model object
    (it is kept, so its id is not reused)."""
    cached = _MODEL_KEYS.get(id(model))
    if cached is None or cached[0] is not model:
        key = tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(model))
        cached = _MODEL_KEYS[id(model)] = (model, key)
    return cached[1]


@dataclass
class _Chunk:
    """One model chunk's share of a rank's static bytes."""

    parameters: int
    peak_gathered: int
    gradients: int
    host_gradients: int
    owned: int
    owned_matrices: int  # of ``owned``, the elements of weight matrices
    buckets: list


def _chunk_memory(config: Config, chunk: list[ParamSpec], tied_embedding: bool, d: int, r: int) -> _Chunk:
    """One DistributedDataParallel's buffers (``param_and_grad_buffer.py``) and this rank's optimizer
    share; ``tied_embedding``: the chunk's output layer borrows its word embedding."""
    sharding = planned_sharding(config, d, r)
    plan = buckets(chunk, config, d)
    sizes = [b.padded for b in plan]
    param_b, grad_b = dtype_bytes(config), gradient_dtype_bytes(config)
    shares = [_owned(b, sharding.num_shards, sharding.shard_rank) for b in plan]
    owned, owned_matrices = sum(s[0] for s in shares), sum(s[1] for s in shares)
    gradients, host_gradients = sharding.stored_gradient_elements(sizes)
    # Which units are whole at once (ZeRO-3's schedule; the other strategies gather nothing, so
    # their ``gathered_elements`` is 0 whatever these say).
    unit_elements: dict = {}
    for b in plan:
        unit_elements[b.unit] = unit_elements.get(b.unit, 0) + b.padded
    order = list(dict.fromkeys(fsdp_unit(spec) for spec in chunk))  # forward order: the root ("") is last
    layers = [u for u in order if u.startswith("decoder.layers.")]
    together = gathered_together(order, prefetch=config.parallel.overlap_param_gather, tied_embedding=tied_embedding,
                                 groups=recompute_groups(config, layers))
    return _Chunk(sharding.stored_parameter_elements(sizes) * param_b,
                  sharding.gathered_elements(unit_elements, together) * param_b,
                  gradients * grad_b, host_gradients * grad_b, owned, owned_matrices, plan)


@functools.lru_cache(maxsize=4096)
def _static_memory(sizing: _Sizing, shapes: tuple, data_parallel_size: int, data_parallel_rank: int,
                   expert_data_parallel_rank: int) -> StaticMemory:
    config = sizing.config
    parallel = config.parallel
    experts_over = expert_data_parallel_size(config, data_parallel_size)
    dense_chunks, expert_chunks, peaks = [], [], []
    for layers, pre_process, post_process in shapes:
        specs = chunk_parameters(config.model, tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                                 layer_numbers=layers, pre_process=pre_process, post_process=post_process,
                                 expert_model_parallel_size=parallel.expert_model_parallel_size,
                                 expert_tensor_parallel_size=parallel.expert_tensor_size)
        tied = pre_process and post_process and not config.model.untie_embeddings_and_output_weights
        dense = _chunk_memory(config, [p for p in specs if not p.expert], tied, data_parallel_size,
                              data_parallel_rank)
        experts = [p for p in specs if p.expert]
        expert = (_chunk_memory(config, experts, False, experts_over, expert_data_parallel_rank) if experts
                  else None)
        dense_chunks.append(dense)
        expert_chunks += [expert] if expert else []
        # Dense weights and experts gather apart (ZeRO-3), each its own units at once.
        peaks.append(dense.peak_gathered + (expert.peak_gathered if expert else 0))
    chunks = dense_chunks + expert_chunks
    parameters = sum(c.parameters for c in chunks)
    # The reference holds its tensor-, pipeline- and expert-parallel shard whole on every data-parallel rank.
    reference = sum(b.real for c in chunks for b in c.buckets) * dtype_bytes(config) if reference_copy(config) else 0
    precomputed = config.data.dpo and config.training.dpo_precompute_ref_log_probs
    owned, owned_matrices = sum(c.owned for c in chunks), sum(c.owned_matrices for c in chunks)
    return StaticMemory(
        parameter_bytes=parameters,
        # A rank runs one chunk at a time, and a chunk releases all it gathered before the next runs.
        peak_parameter_bytes=parameters + max(peaks),
        gradient_bytes=sum(c.gradients for c in chunks),
        optimizer_state_bytes=optimizer_state_bytes(config, owned, owned_matrices),
        optimizer_elements=owned, optimizer_matrix_elements=owned_matrices,
        bucket_elements=tuple(b.padded for c in dense_chunks for b in c.buckets),
        expert_bucket_elements=tuple(b.padded for c in expert_chunks for b in c.buckets),
        host_gradient_bytes=sum(c.host_gradients for c in chunks),
        optimizer_state_on_host=config.optimizer.optimizer_cpu_offload,
        reference_bytes=0 if precomputed else reference, reference_pass_bytes=reference if precomputed else 0)


def reference_copy(config: Config) -> bool:
    """Whether the run builds a second, frozen copy of the model: the reference of --dpo (unless its loss needs none)
    and of --grpo with a KL penalty, except under --peft lora (whose reference is the base with the adapters off)."""
    dpo = config.data.dpo and config.training.dpo_uses_reference
    return (dpo or (config.data.grpo and config.grpo.grpo_beta != 0)) and config.peft.peft != "lora"
