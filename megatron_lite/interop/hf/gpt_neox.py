"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): GPT-2's LayerNorm, biases and GELU with partial rotary embeddings,
and attention and MLP side by side (use_parallel_residual). Its fused query_key_value is laid out per head,
[q_h, k_h, v_h], which is ours when every head is its own key/value group, as NeoX's are."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse
from megatron_lite.interop.hf.gpt2 import GPT2_ACTIVATIONS
from megatron_lite.interop.hf.rope import rope_to_hf, rope_to_ours


def _gpt_neox_to_ours(hf: dict) -> dict:
    activation = hf.get("hidden_act", "gelu")
    refuse(activation not in GPT2_ACTIVATIONS,
           f"hidden_act {activation!r} (supported: {', '.join(GPT2_ACTIVATIONS)})")
    refuse(not hf.get("attention_bias", True), "attention_bias false (biases on the MLP only)")
    heads = hf["num_attention_heads"]
    # Files before transformers 5 give the rotary base and fraction as rotary_emb_base and rotary_pct (default
    # 0.25); rope_parameters' own values win, as in transformers.
    rope = {"rope_theta": float(hf.get("rope_theta") or hf.get("rotary_emb_base", 10000.0)),
            "partial_rotary_factor": float(hf.get("rotary_pct", 0.25))}
    return dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
                num_query_groups=heads, kv_channels=hf["hidden_size"] // heads,
                ffn_hidden_size=hf["intermediate_size"], seq_length=hf["max_position_embeddings"],
                max_position_embeddings=hf["max_position_embeddings"], normalization="LayerNorm",
                norm_epsilon=hf.get("layer_norm_eps", 1e-5), position_embedding_type="rope", swiglu=False,
                add_bias_linear=True, gelu_exact=activation == "gelu",
                parallel_attention_mlp=hf.get("use_parallel_residual", True),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                hidden_dropout=hf.get("hidden_dropout", 0.0), attention_dropout=hf.get("attention_dropout", 0.0),
                **rope_to_ours({**hf, **rope}, partial_rotary=True))


def _gpt_neox_to_hf(config: ModelConfig) -> dict:
    rope = rope_to_hf(config)
    rope["rope_parameters"] = dict(rope["rope_parameters"], partial_rotary_factor=config.rotary_percent)
    return {"num_hidden_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "intermediate_size": config.ffn_hidden_size,
            "max_position_embeddings": config.max_position_embeddings, "layer_norm_eps": config.norm_epsilon,
            "hidden_act": "gelu" if config.gelu_exact else "gelu_new", "attention_bias": True,
            "use_parallel_residual": config.parallel_attention_mlp, "hidden_dropout": config.hidden_dropout,
            "attention_dropout": config.attention_dropout, **rope,
            # transformers < 5 reads these
            "rotary_emb_base": config.rotary_base, "rotary_pct": config.rotary_percent}


GPT_NEOX_FIELDS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
    "max_position_embeddings", "layer_norm_eps", "hidden_act", "attention_bias", "use_parallel_residual",
    "hidden_dropout", "attention_dropout", "rope_parameters", "rope_scaling", "rope_theta", "rotary_emb_base",
    "rotary_pct",
    "classifier_dropout",  # the sequence-classification head's, which a causal LM does not have
    "is_decoder"})  # PretrainedConfig's flag for cross-attention models; GPTNeoXConfig writes it, false


# Exported whenever its naming is (weights.hf_architecture: LayerNorm, biases, GELU, rotary embeddings).
GPT_NEOX = Family("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox", GPT_NEOX_FIELDS, _gpt_neox_to_ours, _gpt_neox_to_hf,
                  also=frozenset({"parallel_attention_mlp"}), padding_idx=False)
