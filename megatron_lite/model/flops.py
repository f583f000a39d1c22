"""FLOPs of the model: what the training log's throughput and MFU count and the planner's step time
charges, one count for both (docs/reference.md, "FLOPs, MFU, throughput").

Every matmul is counted, forward only per token; a backward costs twice its forward.
"""
from __future__ import annotations

from megatron_lite.config import ModelConfig


def attention_core_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of QK^T and attention x V for one token (counted without the causal half)."""
    return 2 * 2 * config.seq_length * config.num_attention_heads * config.head_dim


def transformer_layer_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of one transformer layer for one token, counting every matmul (GQA and SwiGLU included)."""
    h, d = config.hidden_size, config.head_dim
    qkv = 2 * h * (config.num_attention_heads + 2 * config.num_query_groups) * d
    projection = 2 * config.num_attention_heads * d * h
    mlp = 2 * h * config.ffn_hidden_size * (3 if config.swiglu else 2)
    return qkv + attention_core_flops_per_token(config) + projection + mlp


def output_layer_flops_per_token(config: ModelConfig, padded_vocab_size: int) -> float:
    return 2 * config.hidden_size * padded_vocab_size


def num_floating_point_operations(config: ModelConfig, batch_size: int, padded_vocab_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward = 3 x forward), counting every matmul.

    For multi-head attention and a 4h GELU MLP this is Megatron's
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)); GQA and SwiGLU change the QKV and MLP terms.
    """
    per_token_forward = (config.num_layers * transformer_layer_flops_per_token(config)
                         + output_layer_flops_per_token(config, padded_vocab_size))
    return 3.0 * batch_size * config.seq_length * per_token_forward
