"""Tiny GPTs for the generation tests: learned positions or RoPE, full, grouped-query or multi-latent attention,
local (sliding-window) and global layers, torch's fused attention or the unfused one.

A wider initialisation than training's makes a random model's next-token choice depend on
the whole context (at std 0.02 a tied GPT-2 mostly repeats its last token), so a token that
differs anywhere shows up as different continuations.
"""
from __future__ import annotations

from megatron_lite.config import Config, ModelConfig, ParallelConfig, TrainingConfig

VOCAB = 100
BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=48, vocab_size=VOCAB,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2, make_vocab_size_divisible_by=32)
ARCHS = {
    "learned_mha": dict(BASE),
    "rope_gqa": dict(BASE, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
                     add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96),
    "rope_mha": dict(BASE, position_embedding_type="rope"),
    # Gemma 3's layers: a window of 3 tokens before each, every 2nd layer global, the local ones on their own RoPE
    # base; the windowed layers' cache keeps the window only.
    "rope_local_global": dict(BASE, position_embedding_type="rope", window_size=[3, 0], window_attn_skip_freq=2,
                              rotary_base_local=100.0),
    # Megatron-LM's local attention: scaled QK^T and the masked softmax kernel instead of SDPA.
    "learned_mha_unfused": dict(BASE, attention_backend="unfused"),
    # DeepSeek's multi-latent attention (with YaRN): the cache holds the key/value latent and the rotary key.
    "mla": dict(BASE, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                ffn_hidden_size=96, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, rotary_scaling_factor=4.0,
                yarn_original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=0.6),
}


def config_of(arch: str, tp: int = 1, pp: int = 1, **model_fields) -> Config:
    return Config(model=ModelConfig(**{**ARCHS[arch], **model_fields}),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                  training=TrainingConfig(seed=7))


def build(arch: str, tp: int = 1, pp: int = 1, **model_fields):
    """(model chunk of this rank, parallel state); the global weights do not depend on the layout."""
    from megatron_lite.model.builder import build_model
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel

    parallel_state = initialize_model_parallel(tp, pp)
    (model,) = build_model(config_of(arch, tp, pp, **model_fields), parallel_state)
    return model.eval(), parallel_state
