"""Causal self-attention with heads (and grouped-query key/value groups) split over
tensor-parallel ranks: QKV is column-parallel, the output projection row-parallel, so
each rank attends with its own heads and one all-reduce (or reduce-scatter) joins them.
The attention itself (masks, backends, dropout, and under context parallelism the exchange of
keys and values) is ``dot_product_attention.py``'s.
"""
import functools
import math

import torch
from torch import nn

from megatron_lite.process_groups import collectives
from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig, attend_own_chunks
from megatron_lite.model.attention_sinks import register_softmax_offset
from megatron_lite.model.attention_temperature import layer_temperature
from megatron_lite.model.chunked_attention import layer_chunks
from megatron_lite.model.document_rows import core_attention_input
from megatron_lite.model.dot_product_attention import build_core_attention
from megatron_lite.model.embedding import apply_rotary, layer_rotary_concentration
from megatron_lite.model.norm import L2Norm, Norm, ProjectionRMSNorm
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.tensor_parallel.random import checkpoint
from megatron_lite.tensor_parallel.config import TensorParallelConfig


class SelfAttention(nn.Module):
    """The fused QKV weight is laid out per query group, ``[q heads of the group, k, v]``,
    so a contiguous tensor-parallel shard holds whole groups with their keys and values.

    With ``--attention-output-gate`` (Qwen3-Next's gated attention) each group's rows are ``[q heads, their
    gates, k, v]`` (Megatron-LM's order), and each head's output is multiplied by the sigmoid of its gate before
    the output projection.

    Llama 4's layers (--attention-chunk-size, --attn-temperature-tuning) read the queries' ``position_ids``: a
    layer with rotary embeddings attends within its chunk (``chunked_attention.py``), a NoPE layer scales its
    queries by their position's temperature (``attention_temperature.py``).

    ``context_parallel``: when given, this rank holds only its chunks of each sequence and the core
    attention exchanges keys and values with the other context-parallel ranks (``build_core_attention``)."""

    def __init__(self, config: ModelConfig, *, layer_number: int, tp_config: TensorParallelConfig,
                 context_parallel: ContextParallelConfig | None = None, checkpoint_core_attention: bool = False):
        super().__init__()
        self.layer_number = layer_number  # names this layer's entry in a generation's key/value cache
        tp_size = collectives.world_size(tp_config.tp_group)
        if config.num_query_groups % tp_size:
            raise ValueError(f"{config.num_query_groups} key/value groups do not split over {tp_size} tensor-parallel "
                             f"ranks: each rank holds whole groups.")
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_query_groups = config.num_query_groups // tp_size
        self.core_attention = build_core_attention(
            config, layer_number=layer_number, softmax_scale=config.softmax_scale or 1.0 / math.sqrt(self.head_dim),
            heads_per_group=self.heads_per_group, context_parallel=context_parallel)
        self.context_parallel = context_parallel
        self.checkpoint_core_attention = checkpoint_core_attention
        self.rotary_concentration = layer_rotary_concentration(config, layer_number)
        self.output_gate = config.attention_output_gate
        query_rows = config.num_attention_heads * (2 if self.output_gate else 1)
        qkv_size = (query_rows + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, tp_config=tp_config, bias=config.add_bias_linear or config.add_qkv_bias)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp_config=tp_config,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True)
        # Keys and values to put before the sequence's own (prefix tuning, megatron_lite/peft/prefix_tuning.py).
        self.prefix = None
        self.q_layernorm = qk_layernorm(config, config.num_attention_heads, tp_config, layer_number)
        self.k_layernorm = qk_layernorm(config, config.num_query_groups, tp_config, layer_number)
        self.chunks = layer_chunks(config, layer_number)
        self.splits_sequence = context_parallel is not None  # the core then attends to the other ranks' keys too
        self.temperature = layer_temperature(config, layer_number)
        # Here rather than in the core, which context parallelism wraps: one name for the sinks at every layout.
        register_softmax_offset(self, config, self.local_query_groups * self.heads_per_group, tp_config.params_dtype)

    def forward(self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inference_context=None, positions_are_columns: bool = False):
        """[s, b, h] (or [s/tp, b, h] under sequence parallelism) -> (output, bias) before the residual.

        ``attention_mask``: None for causal attention, PackedDocuments for packed examples (``document_rows.py``),
        else bool [b, 1, s, s], True where a query may not attend (the column-parallel QKV has gathered the
        whole sequence, so the mask is never split; under context parallelism s is this rank's positions for the
        rows, the whole sequence for the columns).
        With an ``inference_context`` (generation) the new tokens attend to the cached earlier ones too:
        the mask is then [b, 1, s, cached + s] (a sliding-window layer, which caches only its window, takes
        its last columns). ``position_ids`` [b, s]: the tokens' positions, read by Llama 4's layers only;
        ``positions_are_columns``: known on the host to be the tokens' key columns (``GPTModel.forward``), which
        lets the chunked layers fold their chunks without a mask."""
        qkv, _ = self.linear_qkv(hidden_states)
        seq, batch = qkv.shape[:2]
        qkv = qkv.view(seq, batch, self.local_query_groups, -1)
        query_width = self.heads_per_group * self.head_dim
        if self.output_gate:
            query, gate, key, value = torch.split(qkv, [query_width, query_width, self.head_dim, self.head_dim], dim=-1)
        else:
            query, key, value = torch.split(qkv, [query_width, self.head_dim, self.head_dim], dim=-1)
        query = query.reshape(seq, batch, -1, self.head_dim)
        query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_freqs is not None:
            query = apply_rotary(query, rotary_freqs, self.rotary_concentration)
            key = apply_rotary(key, rotary_freqs, self.rotary_concentration)
        if self.temperature is not None:
            query = self.temperature(query, position_ids)
        if inference_context is not None:
            # Keys are cached after their rotation: a position's angle never changes. A generating model is built
            # without context parallelism (the core is the layer's own DotProductAttention); a context-parallel
            # prefill's cache gathers the whole prompts' keys, which this rank's chunks attend to.
            window = self.core_attention.sliding_window
            window = None if window is None else window.left
            key, value = inference_context.append_key_value(self.layer_number, key, value, window=window)
            if attention_mask is not None:  # a windowed cache returns the most recent keys only
                attention_mask = attention_mask[..., -key.shape[0]:]
        attention_mask = core_attention_input(attention_mask, self.context_parallel, chunked=self.chunks is not None)
        # The prefix joins after the cache, which holds the sequence's own keys only.
        core_attention = functools.partial(self.core_attention, prefix=self.prefix)
        if self.softmax_offset is not None:
            core_attention = functools.partial(core_attention, softmax_offset=self.softmax_offset)
        chunking = dict(position_ids=position_ids, positions_are_columns=positions_are_columns)
        if self.chunks is not None and self.splits_sequence:  # the context-parallel core chunks its blocks itself
            core_attention = functools.partial(core_attention, chunks=self.chunks, **chunking)
        elif self.chunks is not None:  # around the core, chunk by chunk
            core_attention = functools.partial(self.chunks, core_attention, **chunking)
        if inference_context is not None and inference_context.splits_sequence:
            context = attend_own_chunks(self.core_attention, query, key, value, attention_mask,
                                        inference_context.context_parallel, prefix=self.prefix,
                                        softmax_offset=self.softmax_offset, chunks=self.chunks, **chunking)
        elif self.checkpoint_core_attention and self.training:
            context = checkpoint(core_attention, query, key, value, attention_mask)
        else:
            context = core_attention(query, key, value, attention_mask)
        if self.output_gate:
            context = context * torch.sigmoid(gate.reshape(*context.shape))
        return self.linear_proj(context)


def qk_layernorm(config: ModelConfig, num_heads: int, tp_config: TensorParallelConfig, layer_number: int
                 ) -> nn.Module:
    """``--qk-layernorm``'s norm of every query (or key) head over its channels, else the identity; with
    ``--qk-layernorm-whole-projection`` one norm over all ``num_heads`` heads (``ProjectionRMSNorm``); with
    ``--qk-l2-norm`` the weightless one, on layer ``layer_number`` unless it is NoPE (Llama 4 normalises after the
    rotation, which keeps each channel pair's length: the same).

    A per-head norm's weight (head_dim wide) is shared by all heads, and tensor-parallel ranks hold different
    heads: each rank's gradient is a partial sum, all-reduced over the tensor-parallel group as
    sequence-parallel norm weights are (``finalize_model_grads``), hence the ``sequence_parallel`` mark."""
    if config.qk_l2_norm and not config.is_nope_layer(layer_number):
        return L2Norm(config.norm_epsilon)
    if not config.qk_layernorm:
        return nn.Identity()
    if config.qk_layernorm_whole_projection:
        return ProjectionRMSNorm(num_heads * config.head_dim, eps=config.norm_epsilon, tp_group=tp_config.tp_group,
                                 params_dtype=tp_config.params_dtype)
    return Norm(config.head_dim, normalization=config.normalization, eps=config.norm_epsilon,
                apply_layernorm_1p=config.apply_layernorm_1p,
                sequence_parallel=collectives.world_size(tp_config.tp_group) > 1, params_dtype=tp_config.params_dtype)
