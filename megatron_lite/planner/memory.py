"""Memory per GPU: static state, activations times the schedule's in-flight micro-batches, allowances.

A rank's activations at their peak: every (micro-batch, chunk) its schedule table has
forwarded and not yet backwarded (``pipeline.peak_activation_bytes``), each worth its
chunk's layers plus the embedding on the first stage and the output layer's inputs and
the loss's fp32 softmax on the last; plus, under full recomputation, what a chunk's
backward rebuilds while it runs. On top: the cross entropy's
working copies of the logits on the last stage (with --grpo's entropy's), and the cluster's allowance for the
CUDA context, communication buffers and fragmentation. The optimizer step runs once the activations
are freed: what it holds besides its state (Muon's whole matrices, ``muon_step``) counts where it
outgrows them. So does --dpo-precompute-ref-log-probs's reference, held (with a forward's working memory) only
before training.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_lite.planner import activations
from megatron_lite.planner.activations import ActivationSetting
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.muon_step import MuonStep, muon_step
from megatron_lite.planner.parameters import ChunkShape, distinct_stages, rank_chunk_shapes
from megatron_lite.planner.pipeline import peak_activation_bytes
from megatron_lite.planner.static_memory import StaticMemory, dtype_bytes, expert_data_parallel_size, static_memory

GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory, bytes."""

    pipeline_rank: int
    static: StaticMemory
    activation_bytes: float  # kept for backward at the schedule's peak, recomputation's rebuilt layers included
    loss_transient_bytes: float
    allowance_bytes: float
    optimizer_step_bytes: float = 0.0  # held only during the optimizer step (Muon's whole matrices)

    @property
    def total_bytes(self) -> float:
        during_steps = max(self.activation_bytes + self.loss_transient_bytes, self.optimizer_step_bytes,
                           self.static.reference_pass_bytes + self.loss_transient_bytes)
        return self.static.device_bytes + during_steps + self.allowance_bytes

    def as_dict(self) -> dict:
        return {"pipeline_rank": self.pipeline_rank, "parameters_gb": self.static.parameter_bytes / GB,
                "peak_parameters_gb": self.static.peak_parameter_bytes / GB,
                "gradients_gb": self.static.gradient_bytes / GB,
                "gradients_on_host_gb": self.static.host_gradient_bytes / GB,
                "optimizer_state_gb": self.static.optimizer_state_bytes / GB,
                "optimizer_state_on_host": self.static.optimizer_state_on_host,
                "activations_gb": self.activation_bytes / GB, "loss_working_memory_gb": self.loss_transient_bytes / GB,
                "optimizer_step_gb": self.optimizer_step_bytes / GB,
                "allowance_gb": self.allowance_bytes / GB, "total_gb": self.total_bytes / GB}


def activation_setting(layout: Layout, device: str) -> ActivationSetting:
    config = layout.config
    return ActivationSetting(tensor_model_parallel_size=layout.tensor_model_parallel_size,
                             sequence_parallel=config.parallel.sequence_parallel, dtype_bytes=dtype_bytes(config),
                             selective_recompute=config.training.recompute_granularity == "selective",
                             traits=activations.TRAITS[device], context_parallel_size=layout.context_parallel_size)


def tokens_per_rank(layout: Layout) -> int:
    """Positions of a micro-batch this rank holds: its share of each sequence under context parallelism."""
    return layout.config.model.seq_length // layout.context_parallel_size * layout.micro_batch_size


def chunk_activation_bytes(layout: Layout, setting: ActivationSetting, chunk: ChunkShape) -> tuple[float, float]:
    """(bytes kept per micro-batch, bytes added on top while its backward recomputes) of one chunk.

    Full recomputation keeps each recomputed group's input (``uniform``: groups of
    --recompute-num-layers; ``block``: the first --recompute-num-layers layers one by one)
    and rebuilds a group's activations when its backward comes. By then the backward has
    freed what it passed: the loss and output layer's tensors (``uniform`` recomputes the
    last group first), and also the layers kept whole (``block`` recomputes the first layers
    last); the group's input is shared with its rebuilt first layer.
    """
    model, training = layout.config.model, layout.config.training
    tokens = tokens_per_rank(layout)
    etp = layout.config.parallel.expert_tensor_size
    layers, group = len(chunk.layer_numbers), training.recompute_num_layers or 1
    # Each layer's bytes: layers differ in --cp-comm-type, and in their MLP (dense or a mixture of experts).
    per_layer = []
    for n in chunk.layer_numbers:
        layer_setting = dataclasses.replace(setting, cp_comm_type=layout.cp_comm_types[n])
        per_layer.append(activations.layer_bytes_per_token(model, layer_setting, n, etp)
                         + activations.context_parallel_mask_bytes(model, layer_setting, n) / tokens)
    layer = max(per_layer, default=0.0)  # what a recomputed layer rebuilds, at most
    ends = 0.0
    if chunk.pre_process:
        ends += activations.embedding_bytes_per_token(model, setting)
    output = 0.0
    if chunk.post_process:
        vocab = model.padded_vocab_size(setting.tensor_model_parallel_size)
        output = activations.output_bytes_per_token(model, setting, vocab)
    if training.recompute_granularity != "full" or not layers:
        return (sum(per_layer) + ends + output) * tokens, 0.0
    recomputed_input = activations.recomputed_input_bytes_per_token(model, setting)
    if training.recompute_method == "block":
        recomputed = min(group, layers)
        whole = sum(per_layer[recomputed:])
        kept = recomputed * recomputed_input + whole
        rebuilt, freed = (layer - recomputed_input if recomputed else 0.0), whole + output
    else:
        kept = math.ceil(layers / group) * recomputed_input
        rebuilt, freed = min(group, layers) * layer - recomputed_input, output
    return (kept + ends + output) * tokens, max(0.0, rebuilt - freed) * tokens


def loss_transient_bytes_per_token(layout: Layout, setting: ActivationSetting) -> float:
    """The last stage's working memory for the loss, per token: the cross entropy's, and under --grpo the entropy's
    two fp32 copies of the logits on top (measured on one CPU process: a forward with the entropy peaks 2 to 3
    fp32 copies of the logits above one without)."""
    vocab = layout.config.model.padded_vocab_size(layout.tensor_model_parallel_size)
    loss = activations.loss_transient_bytes_per_token(setting, vocab)
    return loss + activations.entropy_transient_bytes_per_token(setting, vocab) if layout.config.data.grpo else loss


def rank_memory(layout: Layout, *, device: str, pipeline_rank: int, data_parallel_rank: int = 0,
                expert_data_parallel_rank: int = 0, allowance_gb: float = 0.0) -> MemoryEstimate:
    """Memory of rank (pipeline_rank, data_parallel_rank) of ``layout``, its experts replica
    ``expert_data_parallel_rank``; ``device`` picks the kernels' accounting. ``data_parallel_rank`` counts in
    the data x context group, which shards the optimizer state."""
    config = layout.config
    setting = activation_setting(layout, device)
    chunks = [chunk_activation_bytes(layout, setting, shape) for shape in rank_chunk_shapes(config, pipeline_rank)]
    peak = peak_activation_bytes(layout.pipeline_model_parallel_size, pipeline_rank, layout.num_microbatches,
                                 tuple(kept for kept, _ in chunks), tuple(extra for _, extra in chunks))
    last = pipeline_rank == layout.pipeline_model_parallel_size - 1
    transient = tokens_per_rank(layout) * loss_transient_bytes_per_token(layout, setting) if last else 0.0
    static = static_memory(config, pipeline_rank=pipeline_rank,
                           data_parallel_size=layout.data_parallel_size_with_context,
                           data_parallel_rank=data_parallel_rank, expert_data_parallel_rank=expert_data_parallel_rank)
    step = (planned_muon_step(layout, pipeline_rank, data_parallel_rank, expert_data_parallel_rank).workspace_bytes
            if config.optimizer.optimizer == "muon" else 0.0)
    return MemoryEstimate(pipeline_rank=pipeline_rank, static=static,
                          activation_bytes=peak, loss_transient_bytes=transient,
                          allowance_bytes=allowance_gb * GB, optimizer_step_bytes=step)


def planned_muon_step(layout: Layout, pipeline_rank: int, data_parallel_rank: int = 0,
                      expert_data_parallel_rank: int = 0) -> MuonStep:
    """``muon_step`` of a rank of ``layout``: its matrices sharded over the data x context ranks, experts over
    their replicas, as the gradient buffers shard them."""
    d = layout.data_parallel_size_with_context
    return muon_step(layout.config, pipeline_rank, data_parallel_size=d,
                     expert_data_parallel_size=expert_data_parallel_size(layout.config, d),
                     data_parallel_rank=data_parallel_rank, expert_data_parallel_rank=expert_data_parallel_rank)


def peak_memory(layout: Layout, *, device: str, allowance_gb: float = 0.0) -> MemoryEstimate:
    """The fullest rank, at data-parallel rank 0 (which owns the least padding).

    Of stages holding the same sizes the earliest is the fullest: the schedules' warm-up,
    and so the micro-batches in flight, shrinks with the pipeline rank.
    """
    estimates = []
    for ranks in distinct_stages(layout.config).values():
        estimates.append(rank_memory(layout, device=device, pipeline_rank=ranks[0], allowance_gb=allowance_gb))
    return max(estimates, key=lambda e: e.total_bytes)
