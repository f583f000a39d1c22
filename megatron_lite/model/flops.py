"""FLOPs of the model: what the training log's throughput and MFU count and the planner's step time
charges, one count for both (docs/reference.md section 7).

Every matmul is counted, forward only per token; a backward costs twice its forward. Attention is counted as
the square of the keys a query may see, without the causal half (Megatron-LM's convention): the whole sequence,
or on a chunked layer (--attention-chunk-size, Llama 4) the squares of its chunks.
"""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.model.chunked_attention import layer_chunks
from megatron_lite.model.delta_rule import CHUNK_SIZE


def attention_core_flops_per_token(config: ModelConfig, layer_number: int = 0) -> float:
    """Forward FLOPs of QK^T and attention x V for one token of layer ``layer_number`` (counted without the causal
    half)."""
    if config.multi_latent_attention:  # queries/keys and values of their own widths
        key_width, value_width = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    else:
        key_width = value_width = config.head_dim
    return 2 * keys_per_query(config, layer_number) * config.num_attention_heads * (key_width + value_width)


def keys_per_query(config: ModelConfig, layer_number: int) -> float:
    """The sequence, or on a chunked layer the sum of its chunks' squares over the sequence (a query sees its
    own chunk's keys: the last chunk may be shorter). Also the scores per query that an attention which
    materialises them keeps (the planner's math path): chunk by chunk, each chunk's square."""
    seq, chunks = config.seq_length, layer_chunks(config, layer_number)
    if chunks is None:
        return seq
    whole, rest = divmod(seq, chunks.chunk_size)
    return (whole * chunks.chunk_size ** 2 + rest ** 2) / seq


def attention_projection_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of the attention's linear layers for one token: QKV (GQA included) and the output, or
    multi-latent attention's down- and up-projections and output."""
    h, heads = config.hidden_size, config.num_attention_heads
    if not config.multi_latent_attention:
        query_heads = heads * (2 if config.attention_output_gate else 1)  # gated attention: the gates too
        qkv = 2 * h * (query_heads + 2 * config.num_query_groups) * config.head_dim
        return qkv + 2 * heads * config.head_dim * h
    query_width = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    query = (2 * h * query_width if config.q_lora_rank is None
             else 2 * h * config.q_lora_rank + 2 * config.q_lora_rank * query_width)
    latent = 2 * h * (config.kv_lora_rank + config.qk_pos_emb_head_dim)
    keys_values = 2 * config.kv_lora_rank * heads * (config.qk_head_dim + config.v_head_dim)
    return query + latent + keys_values + 2 * heads * config.v_head_dim * h


def transformer_layer_flops_per_token(config: ModelConfig, layer_number: int = 0) -> float:
    """Forward FLOPs of layer ``layer_number`` for one token, counting every matmul (GQA, MLA and SwiGLU included;
    a mixture of experts' router, the k experts the token goes to and the shared expert; a gated DeltaNet layer's
    linear attention in place of softmax attention)."""
    if config.is_linear_attention_layer(layer_number):
        return gated_delta_net_flops_per_token(config) + mlp_flops_per_token(config, layer_number)
    return (attention_projection_flops_per_token(config) + attention_core_flops_per_token(config, layer_number)
            + mlp_flops_per_token(config, layer_number))


def gated_delta_net_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of a gated DeltaNet layer for one token (docs/reference.md section 19): its projections, the
    convolution, the state's update and read, and the chunk's within-chunk products."""
    h, key_heads, value_heads = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads
    keys, values = key_heads * config.linear_key_head_dim, value_heads * config.linear_value_head_dim
    projections = 2 * h * (2 * keys + 2 * values + 2 * value_heads) + 2 * values * h
    convolution = 2 * config.linear_conv_kernel_dim * (2 * keys + values)
    state = 4 * value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    chunk = 2 * CHUNK_SIZE * value_heads * (config.linear_key_head_dim + config.linear_value_head_dim)
    return projections + convolution + state + chunk


def mlp_flops_per_token(config: ModelConfig, layer_number: int) -> float:
    def mlp(width: int) -> float:
        return 2 * config.hidden_size * width * (3 if config.swiglu else 2)

    if not config.is_moe_layer(layer_number):
        return mlp(config.ffn_hidden_size)
    shared = config.moe_shared_expert_intermediate_size
    return (2 * config.hidden_size * config.num_experts + config.moe_router_topk * mlp(config.moe_ffn_hidden_size)
            + (mlp(shared) if shared is not None else 0))


def output_layer_flops_per_token(config: ModelConfig, padded_vocab_size: int) -> float:
    return 2 * config.hidden_size * padded_vocab_size


def num_floating_point_operations(config: ModelConfig, batch_size: int, padded_vocab_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward = 3 x forward), counting every matmul.

    For multi-head attention and a 4h GELU MLP this is Megatron's
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)); GQA, MLA and SwiGLU change the attention and MLP terms.
    """
    per_token_forward = (sum(transformer_layer_flops_per_token(config, n) for n in range(config.num_layers))
                         + output_layer_flops_per_token(config, padded_vocab_size)
                         + (config.mtp_num_layers * mtp_depth_flops_per_token(config, padded_vocab_size)
                            if config.mtp_num_layers else 0.0))
    return 3.0 * batch_size * config.seq_length * per_token_forward


def mtp_depth_flops_per_token(config: ModelConfig, padded_vocab_size: int) -> float:
    """A multi-token prediction depth's (model/multi_token_prediction.py): eh_proj ([2h] -> [h]), its layer (the
    decoder's last layer's kind) and its logits, as Megatron-LM's num_floating_point_operations counts them."""
    return (4 * config.hidden_size ** 2 + transformer_layer_flops_per_token(config, config.num_layers)
            + output_layer_flops_per_token(config, padded_vocab_size))
