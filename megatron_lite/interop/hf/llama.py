"""Llama (``LlamaForCausalLM``): RMSNorm, RoPE (and its scalings), SwiGLU, grouped-query attention; the
fields most other families are built on."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse, without_biases
from megatron_lite.interop.hf.rope import rope_to_hf, rope_to_ours


def llama_to_ours(hf: dict) -> dict:
    refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r} (SwiGLU needs silu)")
    heads = hf["num_attention_heads"]
    fields = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
                  kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
                  num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
                  seq_length=hf["max_position_embeddings"], max_position_embeddings=hf["max_position_embeddings"],
                  normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
                  swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                  hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0))
    return dict(fields, **rope_to_ours(hf))


def llama_to_hf(config: ModelConfig) -> dict:
    return {"num_hidden_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
            "head_dim": config.head_dim, "intermediate_size": config.ffn_hidden_size,
            "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
            "hidden_act": "silu", "attention_dropout": config.attention_dropout, **rope_to_hf(config)}


LLAMA_FIELDS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act", "attention_dropout",
    "rope_parameters", "rope_scaling", "rope_theta"})


LLAMA = Family("llama", "LlamaForCausalLM", "llama", LLAMA_FIELDS | {"attention_bias", "mlp_bias", "pretraining_tp"},
               without_biases(llama_to_ours),
               lambda config: dict(llama_to_hf(config), attention_bias=False, mlp_bias=False))
