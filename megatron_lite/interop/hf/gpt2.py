"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, learned positions, GELU (tanh, or exact), Conv1D weights."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse


GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")  # the tanh approximation, or (gelu) the exact one


def _gpt2_to_ours(hf: dict) -> dict:
    refuse(hf.get("activation_function", "gelu_new") not in GPT2_ACTIVATIONS,
           f"activation_function {hf.get('activation_function')!r} (supported: {', '.join(GPT2_ACTIVATIONS)})")
    refuse(not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False),
           "attention scaling other than 1/sqrt(head_dim)")
    refuse(hf.get("add_cross_attention", False), "add_cross_attention")
    return dict(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
                ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"], seq_length=hf["n_positions"],
                max_position_embeddings=hf["n_positions"], normalization="LayerNorm",
                norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), position_embedding_type="learned_absolute",
                swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=not hf.get(
                    "tie_word_embeddings", True),
                hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                gelu_exact=hf.get("activation_function", "gelu_new") == "gelu")


def _gpt2_to_hf(config: ModelConfig) -> dict:
    return {"n_layer": config.num_layers, "n_embd": config.hidden_size, "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size, "n_positions": config.max_position_embeddings,
            "activation_function": "gelu" if config.gelu_exact else "gelu_new",
            "layer_norm_epsilon": config.norm_epsilon,
            "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
            "attn_pdrop": config.attention_dropout}


GPT2_FIELDS = frozenset({
    "n_layer", "n_embd", "n_head", "n_inner", "n_positions", "n_ctx", "vocab_size", "activation_function",
    "layer_norm_epsilon", "resid_pdrop", "embd_pdrop", "attn_pdrop", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "add_cross_attention",
    "reorder_and_upcast_attn",  # float32 attention scores: ours are float32 in fp32 runs anyway
    # The sequence-summary head of GPT2DoubleHeadsModel, which a causal LM does not have.
    "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj"})


GPT2 = Family("gpt2", "GPT2LMHeadModel", "gpt2", GPT2_FIELDS, _gpt2_to_ours, _gpt2_to_hf, padding_idx=False)
