"""Time of one training step: compute, communication, the pipeline bubble and the optimizer.

Per pipeline stage and micro-batch, a model chunk's forward and backward take

- compute: its FLOPs (``model.flops``' count, the training log's; backward twice the forward, plus the
  recomputed forward under full recomputation or the attention core under selective) at
  ``peak x matmul efficiency``;
- tensor parallelism: per layer two all-reduces of the [s, b, h] activation forward and
  two backward (or as many all-gather + reduce-scatter pairs under sequence parallelism:
  the same bytes), plus the embedding's and the output layer's, over NVLink when the
  group fits in a node; none of it overlapped (ours is not);
- pipeline parallelism: one activation or gradient exchange with each neighbour per
  forward and per backward;
- context parallelism: a rank computes for its s/cp positions, and each layer exchanges keys
  and values (``_context_parallel_s``): all_gather gathers every rank's forward and
  reduce-scatters their gradients backward, exposed; p2p passes one rank's block per step
  while the previous one is attended to (backward: the blocks again, with their fp32
  gradients), exposed only where a step's message outlasts a block's attention (on a chunked layer,
  the work of the steps whose blocks any query reaches, ``ring_step_pairs``).
- expert parallelism: per mixture-of-experts layer, the rows of a rank's tokens (k per token, over
  the tensor ranks that split them) all-to-all over the expert-model-parallel group twice forward
  (dispatch, combine) and twice backward, each gathered and reduce-scattered over the expert-tensor
  ranks; without sequence parallelism the tensor ranks also gather the layer's output. Routing is
  taken as balanced: each rank computes k times its tokens' rows, and (ep - 1) / ep of them leave it.

The slowest stage paces the pipeline: ``m x (its forward + backward) x (1 + bubble)``,
the bubble read off our schedule tables. Then data-parallel communication (ring
collectives; ZeRO-2/3 reduce-scatter every micro-batch's gradients and ZeRO-3 gathers
parameters for every forward and backward; experts' over their own replicas), exposed past the
backward (or forward) it overlaps with under ``--overlap-grad-reduce`` / ``--overlap-param-gather``, but never
less than one bucket's worth; and the optimizer step, bound by memory bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel.sharding import chunk_ids
from megatron_lite.model import flops
from megatron_lite.model.chunked_attention import layer_chunks
from megatron_lite.planner.cluster import Cluster, Link
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.memory import planned_muon_step, tokens_per_rank
from megatron_lite.planner.muon_step import muon_step_s
from megatron_lite.planner.parameters import ChunkShape, distinct_stages, rank_chunk_shapes
from megatron_lite.planner.pipeline import bubble_fraction
from megatron_lite.planner.static_memory import (StaticMemory, dtype_bytes, expert_data_parallel_size,
                                                 gradient_dtype_bytes, planned_sharding, static_memory)

# Bytes of memory traffic per fp32 element the optimizer owns, per step. The fused AdamW reads the
# weight, gradient and both moments once and writes back the weight and the moments (28 bytes);
# gradient clipping reads once for the norm and scales once. SGD with momentum (torch's loop):
# three read-write passes; Lion's loop five (its direction, its sign, decay, update, momentum); Muon's
# element-wise part of a matrix three (decay, momentum, update), Newton-Schulz apart (``muon_step``).
OPTIMIZER_TRAFFIC_BYTES = {"adam": 28 + 12, "sgd": 36 + 12, "lion": 52 + 12, "muon": 32 + 12}


def all_reduce_s(message_bytes: float, group_size: int, link: Link) -> float:
    """Ring all-reduce: 2(k-1) steps, each moving 1/k of the message."""
    if group_size == 1:
        return 0.0
    k = group_size
    return 2 * (k - 1) * link.latency_s + 2 * (k - 1) / k * message_bytes / link.bytes_per_second


def gather_or_scatter_s(message_bytes: float, group_size: int, link: Link) -> float:
    """Ring all-gather or reduce-scatter of a ``message_bytes`` whole: half an all-reduce."""
    if group_size == 1:
        return 0.0
    k = group_size
    return (k - 1) * link.latency_s + (k - 1) / k * message_bytes / link.bytes_per_second


def p2p_s(message_bytes: float, link: Link) -> float:
    return link.p2p_latency_s + message_bytes / link.p2p_bytes_per_second


def all_to_all_s(message_bytes: float, group_size: int, link: Link) -> float:
    """Pairwise all-to-all of a rank's ``message_bytes``: k - 1 exchanges, (k - 1) / k of the bytes leave."""
    if group_size == 1:
        return 0.0
    k = group_size
    return (k - 1) * link.latency_s + (k - 1) / k * message_bytes / link.bytes_per_second


@dataclass
class ChunkTime:
    """One micro-batch through one model chunk, seconds."""

    forward_compute: float = 0.0
    backward_compute: float = 0.0
    tensor_parallel: float = 0.0
    context_parallel: float = 0.0
    pipeline_p2p: float = 0.0
    expert_parallel: float = 0.0

    @property
    def total(self) -> float:
        return (self.forward_compute + self.backward_compute + self.tensor_parallel + self.context_parallel
                + self.pipeline_p2p + self.expert_parallel)


@dataclass
class StepTime:
    step_time_s: float
    bubble_fraction: float
    breakdown: dict = field(default_factory=dict)  # seconds per component, summing to step_time_s


def _recomputed_layers(layout: Layout, layers: int) -> int:
    """How many of a chunk's ``layers`` full recomputation runs again (its first ones)."""
    training = layout.config.training
    if training.recompute_granularity != "full":
        return 0
    if training.recompute_method == "block":
        return min(layers, training.recompute_num_layers or 1)
    return layers


def expert_parallel_s(layout: Layout, cluster: Cluster) -> float:
    """One mixture-of-experts layer's forward communication for one micro-batch (its backward: the same again)."""
    config, model = layout.config, layout.config.model
    parallel, t = config.parallel, layout.tensor_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_size
    activation = tokens_per_rank(layout) * model.hidden_size * dtype_bytes(config)
    rows = activation / t * model.moe_router_topk  # this rank's tokens' rows, k each
    dispatch = (all_to_all_s(rows, ep, cluster.link(etp, ep))
                + gather_or_scatter_s(rows * etp, etp, cluster.link(1, etp)))
    own_tokens = 0.0 if parallel.sequence_parallel else gather_or_scatter_s(activation, t, cluster.link(1, t))
    return 2 * dispatch + own_tokens  # dispatch and combine


def chunk_time(layout: Layout, cluster: Cluster, chunk: ChunkShape) -> ChunkTime:
    config, model = layout.config, layout.config.model
    layers, pre_process, post_process = len(chunk.layer_numbers), chunk.pre_process, chunk.post_process
    t, p, d = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.data_parallel_size
    sp = config.parallel.sequence_parallel
    tokens = tokens_per_rank(layout)
    rate = cluster.peak(training_dtype(layout)) * 1e12 * cluster.matmul_efficiency
    layer_flops = [flops.transformer_layer_flops_per_token(model, n) for n in chunk.layer_numbers]
    forward = tokens * (sum(layer_flops) + (flops.output_layer_flops_per_token(
        model, model.padded_vocab_size(t)) if post_process else 0)) / t
    recomputed_layers = _recomputed_layers(layout, layers)
    recompute = tokens * sum(layer_flops[:recomputed_layers]) / t
    if config.training.recompute_granularity == "selective":
        recompute = tokens * sum(flops.attention_core_flops_per_token(model, n) for n in chunk.layer_numbers) / t
    time = ChunkTime(forward_compute=forward / rate, backward_compute=(2 * forward + recompute) / rate)

    activation = tokens * model.hidden_size * dtype_bytes(config)
    tp_link = cluster.link(1, t)
    one_all_reduce = all_reduce_s(activation, t, tp_link)
    tp = (2 * layers + 2 * layers + 2 * recomputed_layers) * one_all_reduce  # forward, backward, recomputation
    tp += one_all_reduce if pre_process else 0
    if post_process:  # the output layer's input gradient, and the loss's three [s, b] all-reduces
        tp += one_all_reduce + 3 * all_reduce_s(tokens * 4, t, tp_link)
    time.tensor_parallel = tp
    recomputed = set(chunk.layer_numbers[:recomputed_layers])
    if config.training.recompute_granularity == "selective":
        recomputed = set(chunk.layer_numbers)
    time.context_parallel = sum(_context_parallel_s(
        layout, cluster, layout.cp_comm_types[n], tokens * flops.attention_core_flops_per_token(model, n) / t / rate,
        recomputed=n in recomputed, step_shares=ring_step_shares(model, layout.context_parallel_size, n))
        for n in chunk.layer_numbers)
    moe_layers = [model.is_moe_layer(n) for n in chunk.layer_numbers]
    if any(moe_layers):  # forward, backward, and the recomputed forward
        time.expert_parallel = (2 * sum(moe_layers) + sum(moe_layers[:recomputed_layers])) * expert_parallel_s(
            layout, cluster)
    if p > 1:
        stride = t * layout.context_parallel_size * d
        time.pipeline_p2p = 2 * p2p_s(activation / (t if sp else 1), cluster.link(stride, p))
    return time


def _context_parallel_s(layout: Layout, cluster: Cluster, comm_type: str, attention_forward: float, *,
                        recomputed: bool, step_shares: list[float] | None = None) -> float:
    """Exposed key/value exchange of one layer for one micro-batch (forward, backward, and the forward again
    when the layer is recomputed); ``attention_forward``: this rank's attention-core forward seconds, of which
    the ring's step k does ``step_shares[k]`` (None: 1/cp each)."""
    cp, t = layout.context_parallel_size, layout.tensor_model_parallel_size
    if cp == 1:
        return 0.0
    own = tokens_per_rank(layout) * _exchanged_key_value_width(layout.config.model) * dtype_bytes(layout.config) / t
    link = cluster.link(t, cp)
    if comm_type == "all_gather":
        return gather_or_scatter_s(own * cp, cp, link) * (3 if recomputed else 2)
    send, send_gradient = p2p_s(own, link), p2p_s(own * 4 / dtype_bytes(layout.config), link)
    # The block sent at step k travels while step k's blocks are attended to; the last step sends nothing.
    blocks = [attention_forward * share for share in (step_shares or [1 / cp] * cp)[:-1]]
    forward = sum(max(send - block, 0.0) for block in blocks)
    # Each backward step sends a block on and its gradient so far, next to a block's backward (2 forwards);
    # the last gradient, on its way home, has nothing left to hide behind.
    backward = sum(max(send + send_gradient - 2 * block, 0.0) for block in blocks) + send_gradient
    return forward * (2 if recomputed else 1) + backward


def ring_step_shares(model: ModelConfig, cp: int, layer_number: int) -> list[float] | None:
    """The share of a p2p layer's attention work at each ring step, on the rank whose steps hide the least, for a
    chunked layer (``model/chunked_attention.py``), whose far blocks are out of every query's reach: most steps
    then carry no work to hide the next block's message behind. None (an even 1/cp a step) on other layers."""
    pairs = ring_step_pairs(model, cp, layer_number)
    if pairs is None or cp == 1:
        return None
    shares = [[count / sum(steps) for count in steps] for steps in pairs]
    return min(shares, key=lambda steps: sum(steps[:-1]))


def ring_step_pairs(model: ModelConfig, cp: int, layer_number: int) -> list[list[int]] | None:
    """Per rank and ring step, the pairs of the rank's chunks and the step's owner's a chunked layer attends to
    (``context_parallel/attention.py``'s RingAttention skips those no query sees, on an unpacked sequence:
    every pair with a later key chunk or only keys of earlier attention chunks); None on other layers."""
    chunks = layer_chunks(model, layer_number)
    if chunks is None:
        return None
    chunk = model.seq_length // (2 * cp)

    def span(chunk_id):
        return range(chunk_id * chunk, (chunk_id + 1) * chunk)

    def attended(rank, owner):
        return sum(chunks.reaches(span(q), span(k))
                   for q in chunk_ids(rank, cp) for k in chunk_ids(owner, cp) if k <= q)

    return [[attended(rank, (rank - step) % cp) for step in range(cp)] for rank in range(cp)]


def _exchanged_key_value_width(model: ModelConfig) -> int:
    """Channels per token of the keys and values context-parallel ranks exchange, over every head: 2 g d, or
    multi-latent attention's expanded keys and values, a (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)."""
    if model.multi_latent_attention:
        return model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    return 2 * model.num_query_groups * model.head_dim


def training_dtype(layout: Layout) -> str:
    training = layout.config.training
    return "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"


def _data_parallel_s(layout: Layout, cluster: Cluster, memory: StaticMemory, stage_forward: float,
                     stage_backward: float) -> float:
    """Exposed data-parallel communication of one stage per step."""
    config, parallel = layout.config, layout.config.parallel
    # Gradients are reduced over the data x context ranks (context-parallel ranks next to each other); experts'
    # over their replicas, ep x etp ranks apart.
    t, d = layout.tensor_model_parallel_size, layout.data_parallel_size_with_context
    edp, replicas_stride = expert_data_parallel_size(config, d), parallel.expert_model_parallel_size * (
        parallel.expert_tensor_size)
    return (_buckets_s(layout, memory.bucket_elements, d, cluster.link(t, d), stage_forward, stage_backward)
            + _buckets_s(layout, memory.expert_bucket_elements, edp, cluster.link(replicas_stride, edp),
                         stage_forward, stage_backward))


def _buckets_s(layout: Layout, bucket_elements: tuple, group_size: int, link: Link, stage_forward: float,
               stage_backward: float) -> float:
    """Exposed communication of one kind of buckets (dense or experts') over the group of their replicas."""
    config = layout.config
    if group_size == 1 or not bucket_elements:
        return 0.0
    padded = sum(bucket_elements)
    last_bucket = max(bucket_elements) / padded  # the share no overlap can hide
    grads, params = padded * gradient_dtype_bytes(config), padded * dtype_bytes(config)

    def exposed(window: float):
        return lambda seconds, overlapped: max(seconds - window, seconds * last_bucket) if overlapped else seconds

    # Which collectives run how often, and what hides them, is the strategy's.
    return planned_sharding(config, group_size).step_communication_s(
        microbatches=layout.num_microbatches, all_reduce_s=all_reduce_s(grads, group_size, link),
        reduce_scatter_s=gather_or_scatter_s(grads, group_size, link),
        all_gather_s=gather_or_scatter_s(params, group_size, link), exposed_in_backward=exposed(stage_backward),
        exposed_in_forward=exposed(stage_forward))


def _optimizer_s(layout: Layout, cluster: Cluster, memory: StaticMemory, pipeline_rank: int) -> float:
    """The optimizer step and the gradient buffer's zeroing, at the device's memory bandwidth; Muon's
    Newton-Schulz iterations and matrix moves besides (``muon_step``)."""
    config, optimizer = layout.config, layout.config.optimizer
    elements, matrices = memory.optimizer_elements, memory.optimizer_matrix_elements
    if optimizer.optimizer == "muon":
        traffic = (matrices * OPTIMIZER_TRAFFIC_BYTES["muon"]
                   + (elements - matrices) * OPTIMIZER_TRAFFIC_BYTES[optimizer.muon_scalar_optimizer])
    else:
        traffic = elements * OPTIMIZER_TRAFFIC_BYTES[optimizer.optimizer]
    traffic += memory.gradient_bytes
    if dtype_bytes(config) != 4:  # main grads copied in, main params copied back
        traffic += elements * (gradient_dtype_bytes(config) + 4 + 4 + dtype_bytes(config))
    seconds = traffic / (cluster.memory_bandwidth_gbs * 1e9)
    if optimizer.optimizer == "muon":
        seconds += muon_step_s(planned_muon_step(layout, pipeline_rank), config, cluster, _muon_links(layout, cluster))
    return seconds


def _muon_links(layout: Layout, cluster: Cluster) -> dict[str, Link]:
    """The links of the groups Muon's step communicates over (the gradient reduction's, and the tensor ranks')."""
    parallel = layout.config.parallel
    t, d = layout.tensor_model_parallel_size, layout.data_parallel_size_with_context
    etp = parallel.expert_tensor_size
    return {"data": cluster.link(t, d), "tensor": cluster.link(1, t), "expert_tensor": cluster.link(1, etp),
            "expert_data": cluster.link(parallel.expert_model_parallel_size * etp,
                                        expert_data_parallel_size(layout.config, d))}


def step_time(layout: Layout, cluster: Cluster) -> StepTime:
    m = layout.num_microbatches
    stages = []  # per group of alike stages: (chunk times, exposed data-parallel time, optimizer time)
    for ranks in distinct_stages(layout.config).values():
        chunks = [chunk_time(layout, cluster, shape) for shape in rank_chunk_shapes(layout.config, ranks[0])]
        forward = sum(c.forward_compute for c in chunks)
        backward = sum(c.backward_compute for c in chunks)
        memory = static_memory(layout.config, pipeline_rank=ranks[0],
                               data_parallel_size=layout.data_parallel_size_with_context)
        stages.append((chunks, _data_parallel_s(layout, cluster, memory, forward, backward),
                       _optimizer_s(layout, cluster, memory, ranks[0])))
    chunks = max((chunks for chunks, _, _ in stages), key=lambda cs: sum(c.total for c in cs))
    bubble = bubble_fraction(layout.pipeline_model_parallel_size, m, layout.virtual_pipeline_model_parallel_size)
    data_parallel, optimizer = max(((dp, opt) for _, dp, opt in stages), key=sum)
    breakdown = {"compute": m * sum(c.forward_compute + c.backward_compute for c in chunks),
                 "tensor_parallel": m * sum(c.tensor_parallel for c in chunks),
                 "context_parallel": m * sum(c.context_parallel for c in chunks),
                 "pipeline_p2p": m * sum(c.pipeline_p2p for c in chunks),
                 **({"expert_parallel": m * sum(c.expert_parallel for c in chunks)}
                    if layout.config.model.num_experts is not None else {}),
                 "pipeline_bubble": m * sum(c.total for c in chunks) * bubble,
                 "data_parallel": data_parallel, "optimizer": optimizer}
    return StepTime(step_time_s=math.fsum(breakdown.values()), bubble_fraction=bubble, breakdown=breakdown)
