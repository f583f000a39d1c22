"""Causal self-attention with heads (and grouped-query key/value groups) split over
tensor-parallel ranks: QKV is column-parallel, the output projection row-parallel, so
each rank attends with its own heads and one all-reduce (or reduce-scatter) joins them.

The core attention is torch's ``scaled_dot_product_attention`` (``--attention-backend``
auto, flash, fused), or with unfused/local the explicit path Megatron-LM's local
DotProductAttention takes: scaled QK^T, the fused causal masked softmax, dropout, then V.
"""
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.process_groups import collectives
from megatron_lite.config import ModelConfig
from megatron_lite.model.norm import Norm, ProjectionRMSNorm
from megatron_lite.model.sliding_window import layer_window
from megatron_lite.model.soft_capping import soft_capping
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.tensor_parallel.random import checkpoint, get_rng_tracker
from megatron_lite.tensor_parallel.config import TensorParallelConfig


class SelfAttention(nn.Module):
    """The fused QKV weight is laid out per query group, ``[q heads of the group, k, v]``,
    so a contiguous tensor-parallel shard holds whole groups with their keys and values."""

    def __init__(self, config: ModelConfig, *, layer_number: int, tp_config: TensorParallelConfig,
                 checkpoint_core_attention: bool = False):
        super().__init__()
        self.layer_number = layer_number  # names this layer's entry in a generation's key/value cache
        tp_size = collectives.world_size(tp_config.tp_group)
        if config.num_query_groups % tp_size:
            raise ValueError(f"{config.num_query_groups} key/value groups do not split over {tp_size} tensor-parallel "
                             f"ranks: each rank holds whole groups.")
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_query_groups = config.num_query_groups // tp_size
        self.attention_dropout = config.attention_dropout
        self.softmax_scale = config.softmax_scale or 1.0 / math.sqrt(self.head_dim)
        # Capping acts between QK^T and the softmax, which only the explicit path exposes.
        self.logit_capping = soft_capping(config.attn_logit_softcapping)
        self.unfused = config.attention_backend in ("unfused", "local") or self.logit_capping is not None
        self.checkpoint_core_attention = checkpoint_core_attention
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, tp_config=tp_config, bias=config.add_bias_linear or config.add_qkv_bias)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp_config=tp_config,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True)
        # Keys and values to put before the sequence's own (prefix tuning, megatron_lite/peft/prefix_tuning.py).
        self.prefix = None
        self.q_layernorm = qk_layernorm(config, config.num_attention_heads, tp_config)
        self.k_layernorm = qk_layernorm(config, config.num_query_groups, tp_config)
        self.sliding_window = layer_window(config, layer_number)

    def forward(self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None, inference_context=None):
        """[s, b, h] (or [s/tp, b, h] under sequence parallelism) -> (output, bias) before the residual.

        ``attention_mask``: None for causal attention, else bool [b, 1, s, s], True where a query may not
        attend (the column-parallel QKV has gathered the whole sequence, so the mask is never split).
        With an ``inference_context`` (generation) the new tokens attend to the cached earlier ones too:
        the mask is then [b, 1, s, cached + s] (a sliding-window layer, which caches only its window, takes
        its last columns)."""
        qkv, _ = self.linear_qkv(hidden_states)
        seq, batch = qkv.shape[:2]
        qkv = qkv.view(seq, batch, self.local_query_groups, (self.heads_per_group + 2) * self.head_dim)
        query, key, value = torch.split(
            qkv, [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        query = query.reshape(seq, batch, -1, self.head_dim)
        query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_freqs is not None:
            query = kernels.apply_rotary_pos_emb(query, rotary_freqs)
            key = kernels.apply_rotary_pos_emb(key, rotary_freqs)
        if inference_context is not None:
            # Keys are cached after their rotation: a position's angle never changes.
            window = None if self.sliding_window is None else self.sliding_window.left
            key, value = inference_context.append_key_value(self.layer_number, key, value, window=window)
            if attention_mask is not None:  # a windowed cache returns the most recent keys only
                attention_mask = attention_mask[..., -key.shape[0]:]
        if self.prefix is not None:  # after the cache, which holds the sequence's own keys only
            key, value, attention_mask = self.prefix(key, value, attention_mask)
        if self.checkpoint_core_attention and self.training:
            context = checkpoint(self._core_attention, query, key, value, attention_mask)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)

    def _core_attention(self, query, key, value, attention_mask=None):
        """softmax(QK^T * scale) V over this rank's heads; [s, b, heads, d] -> [s, b, heads * d]."""
        seq, batch = query.shape[:2]
        # [s, b, n, d] -> [b, n, s, d]; each key/value group serves heads_per_group query heads.
        query = query.permute(1, 2, 0, 3)
        key, value = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        if self.heads_per_group > 1:
            key = key.repeat_interleave(self.heads_per_group, dim=1)
            value = value.repeat_interleave(self.heads_per_group, dim=1)
        dropout = self.attention_dropout if self.training else 0.0
        # Heads differ across tensor-parallel ranks, so their dropout masks must too.
        rng = get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        attention_mask = _mask_after_cache(attention_mask, query.shape[2], key.shape[2], query.device)
        if self.sliding_window is not None:
            attention_mask = self.sliding_window.mask(attention_mask, query.shape[2], key.shape[2], query.device)
        with rng:
            if self.unfused:
                context = _unfused_attention(query, key, value, dropout, attention_mask, self.softmax_scale,
                                             self.logit_capping)
            elif attention_mask is None:
                context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                                         scale=self.softmax_scale)
            else:  # SDPA's boolean mask marks what may be attended
                context = F.scaled_dot_product_attention(query, key, value, attn_mask=~attention_mask,
                                                         dropout_p=dropout, scale=self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def qk_layernorm(config: ModelConfig, num_heads: int, tp_config: TensorParallelConfig) -> nn.Module:
    """``--qk-layernorm``'s norm of every query (or key) head over its channels, else the identity; with
    ``--qk-layernorm-whole-projection`` one norm over all ``num_heads`` heads (``ProjectionRMSNorm``).

    A per-head norm's weight (head_dim wide) is shared by all heads, and tensor-parallel ranks hold different
    heads: each rank's gradient is a partial sum, all-reduced over the tensor-parallel group as
    sequence-parallel norm weights are (``finalize_model_grads``), hence the ``sequence_parallel`` mark."""
    if not config.qk_layernorm:
        return nn.Identity()
    if config.qk_layernorm_whole_projection:
        return ProjectionRMSNorm(num_heads * config.head_dim, eps=config.norm_epsilon, tp_group=tp_config.tp_group,
                                 params_dtype=tp_config.params_dtype)
    return Norm(config.head_dim, normalization=config.normalization, eps=config.norm_epsilon,
                apply_layernorm_1p=config.apply_layernorm_1p,
                sequence_parallel=collectives.world_size(tp_config.tp_group) > 1, params_dtype=tp_config.params_dtype)


def _unfused_attention(query, key, value, dropout: float, attention_mask, scale: float, logit_capping=None):
    """softmax(QK^T * scale) V with the probabilities materialised; [b, n, s, d] in and out.

    As Megatron-LM, the scale (1/sqrt(d) unless --softmax-scale) goes into the QK^T matmul (so fp16
    scores stay in range) and the softmax kernel, which takes [b * n, sq, sk], applies the causal mask;
    an ``attention_mask`` (True = may not attend) replaces it. ``logit_capping`` (soft_capping.py)
    caps the scaled scores before the mask.
    """
    batch, heads, sq, d = query.shape
    sk = key.shape[2]
    scores = torch.baddbmm(query.new_empty(batch * heads, sq, sk), query.reshape(-1, sq, d),
                           key.reshape(-1, sk, d).transpose(1, 2), beta=0.0, alpha=scale)
    if logit_capping is not None:
        scores = logit_capping(scores)
    if attention_mask is None:
        probs = kernels.scaled_upper_triang_masked_softmax(scores, 1.0)
    else:
        probs = kernels.scaled_masked_softmax(scores.view(batch, heads, sq, sk), attention_mask, 1.0).view(-1, sq, sk)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.bmm(probs, value.reshape(-1, sk, d)).view(batch, heads, sq, d)


def _mask_after_cache(attention_mask, query_length: int, key_length: int, device):
    """The mask (True = may not attend) of queries that follow cached keys (generation) or a prefix: they
    are the last ``query_length`` of ``key_length`` positions, each seeing the keys up to its own, so one
    new token sees them all. A given mask, or no earlier keys (None: causal), is left as it is."""
    if attention_mask is not None or query_length == key_length:
        return attention_mask
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).triu(key_length - query_length + 1)
