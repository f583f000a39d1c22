"""Attention sinks (Megatron-LM's ``--softmax-type``; gpt-oss's ``sinks``): one more logit per head in the
softmax's denominator, a key that every query sees and whose value is zero,

    p_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik)),

so a head can give a query's attention to nothing at all rather than spread it over keys it has no use for.
``off-by-one`` fixes the sink at 0 (the softmax plus one of Evan Miller's note); ``learnable`` learns it, one
``softmax_offset`` per head (Megatron-Core's name), split over tensor-parallel ranks with the heads.

The sinks take the explicit attention path (``dot_product_attention.py``), whose softmax this module's
``sink_softmax`` replaces: SDPA's kernels have no column to add. The parameter is the layer's
(``SelfAttention.softmax_offset``), handed to the core with each call, so context parallelism's wrappers keep its
name; their ring joins the sink to the log-sum-exp merge once (``context_parallel/block_attention.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.tensor_parallel import set_tensor_model_parallel_attributes


def register_softmax_offset(module: nn.Module, config: ModelConfig, local_heads: int,
                            params_dtype: torch.dtype) -> None:
    """``module.softmax_offset``, this rank's sink logits [local_heads]: a parameter (learnable), a buffer of zeros
    outside the checkpoint (off-by-one), or None (vanilla)."""
    if config.softmax_type != "learnable":
        zeros = torch.zeros(local_heads, dtype=params_dtype) if config.softmax_type == "off-by-one" else None
        module.register_buffer("softmax_offset", zeros, persistent=False)
        return
    offset = nn.Parameter(torch.empty(local_heads, dtype=params_dtype))
    set_tensor_model_parallel_attributes(offset, is_parallel=True, partition_dim=0, partition_stride=1)
    module.softmax_offset = offset


def sink_softmax(scores: torch.Tensor, offset: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The probabilities of scaled scores [b, heads, sq, sk] with each head's sink in the denominator, in fp32
    and returned in the scores' dtype; ``attention_mask`` (bool, True = may not attend) broadcasts to them. A
    query that sees no key gives the sink all of its attention: zeros, never NaN."""
    dtype, scores = scores.dtype, scores.float()
    if attention_mask is not None:
        scores = scores.masked_fill(attention_mask, float("-inf"))
    sinks = offset.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1].to(dtype)
