"""Causal self-attention with heads (and grouped-query key/value groups) split over
tensor-parallel ranks: QKV is column-parallel, the output projection row-parallel, so
each rank attends with its own heads and one all-reduce (or reduce-scatter) joins them."""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.process_groups import collectives
from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.tensor_parallel.random import checkpoint, get_rng_tracker


class SelfAttention(nn.Module):
    """The fused QKV weight is laid out per query group, ``[q heads of the group, k, v]``,
    so a contiguous tensor-parallel shard holds whole groups with their keys and values."""

    def __init__(self, config: ModelConfig, *, tp_group, sequence_parallel: bool, params_dtype: torch.dtype,
                 checkpoint_core_attention: bool = False):
        super().__init__()
        tp_size = collectives.world_size(tp_group)
        if config.num_query_groups % tp_size:
            raise ConfigError(f"--num-query-groups ({config.num_query_groups}) must be divisible by "
                              f"--tensor-model-parallel-size ({tp_size}).")
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_query_groups = config.num_query_groups // tp_size
        self.attention_dropout = config.attention_dropout
        self.checkpoint_core_attention = checkpoint_core_attention
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, tp_group=tp_group, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp_group=tp_group,
            bias=config.add_bias_linear, input_is_parallel=True, sequence_parallel=sequence_parallel,
            skip_bias_add=True, params_dtype=params_dtype)

    def forward(self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None):
        """[s, b, h] (or [s/tp, b, h] under sequence parallelism) -> (output, bias) before the residual.

        ``attention_mask``: None for causal attention, else bool [b, 1, s, s], True where a query may not
        attend (the column-parallel QKV has gathered the whole sequence, so the mask is never split)."""
        qkv, _ = self.linear_qkv(hidden_states)
        seq, batch = qkv.shape[:2]
        qkv = qkv.view(seq, batch, self.local_query_groups, (self.heads_per_group + 2) * self.head_dim)
        query, key, value = torch.split(
            qkv, [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        query = query.reshape(seq, batch, -1, self.head_dim)
        if rotary_freqs is not None:
            query = kernels.apply_rotary_pos_emb(query, rotary_freqs)
            key = kernels.apply_rotary_pos_emb(key, rotary_freqs)
        if self.checkpoint_core_attention and self.training:
            context = checkpoint(self._core_attention, query, key, value, attention_mask)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)

    def _core_attention(self, query, key, value, attention_mask=None):
        """softmax(QK^T / sqrt(d)) V over this rank's heads; [s, b, heads, d] -> [s, b, heads * d]."""
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
        with rng:
            if attention_mask is None:
                context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True)
            else:  # SDPA's boolean mask marks what may be attended
                context = F.scaled_dot_product_attention(query, key, value, attn_mask=~attention_mask,
                                                         dropout_p=dropout)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)
