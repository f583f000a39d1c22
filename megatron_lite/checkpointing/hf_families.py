"""The Hugging Face model families megatron_lite imports and exports, each a spec of ``config.json``.

A family is its ``model_type``, the transformers class that loads it, how its weights are named
(``naming``: GPT-2's, Llama's, Phi-3's, Gemma's or DeepSeek's, or Llama's with Mixtral's or Qwen-MoE's
expert names, ``hf_interop``), the ModelConfig features it implies, and every ``config.json`` field it
reads. A field outside that list (and outside ``GENERIC_FIELDS``, which change nothing we compute) is
refused by name at import, never dropped: an unread field is a silently different model. A null field
sets nothing and passes.

    family   features                                  refused
    gpt2     LayerNorm, learned positions, GELU tanh   other activations and attention scalings
             (or exact: --gelu-exact)
    gpt_neox LayerNorm, biases, GELU (exact: Pythia's   hidden_act other than a GELU, attention_bias
             gelu), RoPE on rotary_pct of each head,   false
             attention and MLP in parallel
             (use_parallel_residual:
             --parallel-attention-mlp), untied
             embed_out
    llama    RMSNorm, RoPE (+ linear, llama3, yarn     attention_bias, mlp_bias, other rope types
             scaling)
    qwen2    llama + bias on q/k/v (--add-qkv-bias)    use_sliding_window, non-full layer_types
    qwen3    llama + q/k RMSNorm (--qk-layernorm),     attention_bias, use_sliding_window
             head_dim (--kv-channels)
    mistral  llama + sliding_window (--window-size)
    smollm3  llama + NoPE layers (no_rope_layers, or    use_sliding_window, layer_types other than
             every no_rope_layer_interval-th:          full_attention, attention_bias, mlp_bias
             --no-rope-freq, 1 for a NoPE layer)
    phi3     llama + fused qkv_proj, gate_up_proj;     embd_pdrop != resid_pdrop, longrope
             partial_rotary_factor (--rotary-percent),
             sliding_window
    mixtral  mistral + a mixture of experts in every   router_jitter_noise
             layer (num_local_experts, top-k softmax
             routing; router_aux_loss_coef, see below)
    qwen3    qwen3 + experts where decoder_sparse_step     qwen3's; no MoE layer at all
    _moe     and mlp_only_layers put them (dense MLPs
             elsewhere, intermediate_size wide), top-k
             of a softmax renormalised (norm_topk_prob)
             or not (--moe-router-pre-softmax)
    olmoe    llama + q/k RMSNorm over the whole            attention_bias, clip_qkv
             projection (--qk-layernorm-whole-
             projection), experts in every layer,
             norm_topk_prob as qwen3_moe
    gemma2   llama + RMSNorm (1 + w), post-sublayer    attention_bias, hidden_activation other than
             norms, sqrt(hidden) embedding scale,      gelu_pytorch_tanh, use_bidirectional_attention,
             GeGLU, query_pre_attn_scalar, attention   layer_types other than every Nth layer global
             and final-logit soft-capping, sliding /   (or no layer sliding)
             global layers, tied embeddings
    gemma3   gemma2 + q/k RMSNorm (1 + w), every 6th   gemma2's; rope_parameters.sliding_attention
    _text    layer global by default, the local        other than an unscaled rope_theta
             layers' own RoPE base, never scaled
             (--rotary-base-local)
    deepseek_v3, deepseek_v2:
             llama's norms and MLP + multi-latent      num_key_value_heads other than the heads,
             attention (--multi-latent-attention),     attention_bias, mlp_bias, rope scaling other
             interleaved rotary rows, rope yarn; after than yarn; V3: norm_topk_prob false, groups
             first_k_dense_replace dense layers,       not scored by their best two; V2:
             experts and shared experts: V3 sigmoid    norm_topk_prob true, topk_method other than
             with e_score_correction_bias (our expert  greedy and group_limited_greedy
             bias), groups by their best two; V2 the
             softmax's top-k, groups by their best
             (--moe-router-group-score max); both
             x routed_scaling_factor

On export the family is the one the model's features call for (``family_of``), or the one named
(``named_family``, the converter's --hf-model-type): Phi-3 computes what Llama or Mistral does, DeepSeek-V2
what V3 does for dense layers.

The MoE families' load-balancing loss (transformers' ``load_balancing_loss_func``) pools the router
statistics of all L mixture-of-experts layers, E / (L T)^2 * sum_e C_e P_e with C and P summed over
layers and k assignments per token: our --moe-router-load-balancing-type pooled_aux_loss, set on import
with --moe-aux-loss-coeff = router_aux_loss_coef (Megatron-LM's aux_loss sums per-layer losses, each
E / (k T^2) * sum_e C_e P_e, which differs beyond one layer). transformers adds the loss to the training
loss only with output_router_logits true, so an import without it trains with coefficient 0.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_lite.checkpointing.architecture import defines_function
from megatron_lite.checkpointing.hf_pad_token import pad_token_id_from_hf
from megatron_lite.config import YARN_DEFAULTS, ConfigError, ModelConfig

# PretrainedConfig's own fields and the token ids: bookkeeping, no effect on the logits.
GENERIC_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "tie_word_embeddings"})

GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")  # the tanh approximation, or (gelu) the exact one
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Megatron-LM's --use-rope-scaling fixes these (see model/rope_scaling.py).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class
    naming: str  # "gpt2" or "llama": how the weights are named (hf_interop)
    fields: frozenset  # config.json fields it reads
    to_ours: Callable[[dict], dict]  # config.json -> ModelConfig fields
    to_hf: Callable[[ModelConfig], dict]  # ModelConfig -> the family's own config.json fields
    features: dict = dataclasses.field(default_factory=dict)  # ModelConfig fields that select it on export
    also: frozenset = frozenset()  # optional features it may have besides (Mixtral's sliding window)
    padding_idx: bool = True  # transformers' input embedding gives the pad row no gradient (all but GPT-2, GPT-NeoX)


def refuse(condition: bool, what: str) -> None:
    if condition:
        raise ConfigError(f"this Hugging Face model uses {what}, which megatron_lite's GPT does not implement.")


# ---------------------------------------------------------------------------------------------
# GPT-2


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


# ---------------------------------------------------------------------------------------------
# GPT-NeoX (Pythia): GPT-2's LayerNorm, biases and GELU with partial rotary embeddings, and attention and
# MLP side by side (use_parallel_residual). Its fused query_key_value is laid out per head, [q_h, k_h, v_h],
# which is ours when every head is its own key/value group, as NeoX's are.


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
                **_rope_to_ours({**hf, **rope}, partial_rotary=True))


def _gpt_neox_to_hf(config: ModelConfig) -> dict:
    rope = _rope_to_hf(config)
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


# ---------------------------------------------------------------------------------------------
# Llama and the families built on it


def _rope_to_ours(hf: dict, *, partial_rotary: bool = False, latent: bool = False) -> dict:
    """RoPE base and scaling from ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta``;
    with ``partial_rotary`` (Phi-3) the rotated fraction of each head too. YaRN is --position-embedding-type
    yarn, or with multi-latent attention (``latent``, DeepSeek) --rope-type yarn."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    refuse(rope_type not in ROPE_TYPES,
           f"rope scaling {rope_type!r} (rope_parameters.rope_type; supported: {', '.join(ROPE_TYPES)})")
    fields = {"rotary_base": float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))}
    rotary_percent = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    refuse(rotary_percent != 1.0 and not partial_rotary, "rope_parameters.partial_rotary_factor other than 1")
    if partial_rotary:
        fields["rotary_percent"] = rotary_percent
    if rope_type == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(rope.pop("factor"))
    elif rope_type == "llama3":
        fields.update(use_rope_scaling=True, rope_scaling_factor=float(rope.pop("factor")))
        for name, value in LLAMA3_ROPE.items():
            refuse(rope.pop(name, value) != value, f"rope_parameters.{name} other than {value} with rope_type llama3")
    elif rope_type == "yarn":
        fields.update(_yarn_to_ours(rope, hf), **({"rope_type": "yarn"} if latent else
                                                   {"position_embedding_type": "yarn"}))
    refuse(bool(rope), f"rope_parameters field(s) {', '.join(sorted(rope))} with rope_type {rope_type!r}")
    return fields


def _yarn_to_ours(rope: dict, hf: dict) -> dict:
    """YaRN's fields, taken out of ``rope``. transformers scales the rotated channels by mscale(f, mscale) /
    mscale(f, mscale_all_dim) only when both are set (non-zero), else by mscale(f, 1): Megatron-LM's formula
    with --mscale 1 --mscale-all-dim 0. Only one of them set means something else to each: refused."""
    refuse("factor" not in rope, "rope_type yarn without rope_parameters.factor")
    mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    refuse(bool(mscale) != bool(mscale_all_dim),
           f"rope_parameters.mscale {mscale} with mscale_all_dim {mscale_all_dim} (transformers reads mscale only "
           f"with a non-zero mscale_all_dim; give both or neither)")
    refuse(rope.pop("attention_factor", None) is not None, "rope_parameters.attention_factor (YaRN's concentration "
                                                           "given outright, not from mscale and mscale_all_dim)")
    # transformers prefers a top-level original_max_position_embeddings (Phi-3), then rope_parameters', then
    # the model's own context.
    original = hf.get("original_max_position_embeddings") or rope.pop("original_max_position_embeddings",
                                                                      hf["max_position_embeddings"])
    rope.pop("original_max_position_embeddings", None)
    return dict(rotary_scaling_factor=float(rope.pop("factor")), mscale=float(mscale or 1.0),
                mscale_all_dim=float(mscale_all_dim or 0.0), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.pop("beta_fast", None) or YARN_DEFAULTS["yarn_beta_fast"]),
                yarn_beta_slow=float(rope.pop("beta_slow", None) or YARN_DEFAULTS["yarn_beta_slow"]),
                yarn_correction_range_round_to_int=bool(rope.pop("truncate", True)))


def _rope_to_hf(config: ModelConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rotary_seq_len_interpolation_factor is not None:
        rope.update(rope_type="linear", factor=config.rotary_seq_len_interpolation_factor)
    elif config.use_rope_scaling:
        rope.update(rope_type="llama3", factor=config.rope_scaling_factor, **LLAMA3_ROPE)
    elif config.yarn:
        rope.update(_yarn_to_hf(config))
    # transformers < 5 reads rope_theta (and rope_scaling), 5 reads rope_parameters
    legacy = {"rope_scaling": rope} if rope["rope_type"] != "default" else {}
    return {"rope_theta": config.rotary_base, "rope_parameters": rope, **legacy}


def _yarn_to_hf(config: ModelConfig) -> dict:
    mscales = (config.mscale, config.mscale_all_dim)
    if mscales != (1.0, 0.0) and 0.0 in mscales:
        raise ConfigError(f"--mscale {config.mscale} with --mscale-all-dim {config.mscale_all_dim} has no Hugging Face "
                          f"form: transformers reads YaRN's mscale only when both are non-zero (or takes 1 and 0).")
    rope = {"rope_type": "yarn", "factor": config.rotary_scaling_factor,
            "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
            "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow,
            "truncate": config.yarn_correction_range_round_to_int}
    return rope if mscales == (1.0, 0.0) else dict(rope, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)


def _llama_to_ours(hf: dict) -> dict:
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
    return dict(fields, **_rope_to_ours(hf))


def _llama_to_hf(config: ModelConfig) -> dict:
    return {"num_hidden_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
            "head_dim": config.head_dim, "intermediate_size": config.ffn_hidden_size,
            "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
            "hidden_act": "silu", "attention_dropout": config.attention_dropout, **_rope_to_hf(config)}


LLAMA_FIELDS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act", "attention_dropout",
    "rope_parameters", "rope_scaling", "rope_theta"})


def _without_biases(to_ours: Callable[[dict], dict]) -> Callable[[dict], dict]:
    def read(hf: dict) -> dict:
        refuse(hf.get("attention_bias", False), "attention_bias (biases on q, k, v and o_proj)")
        refuse(hf.get("mlp_bias", False), "mlp_bias")
        return to_ours(hf)
    return read


def _qwen_attention(to_ours: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """Qwen2/Qwen3 name a per-layer sliding window that their released dense models leave off."""
    def read(hf: dict) -> dict:
        refuse(hf.get("use_sliding_window", False), "use_sliding_window (sliding attention in some layers)")
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        refuse(layer_types != {"full_attention"}, f"layer_types {sorted(layer_types)} (only full_attention)")
        return to_ours(hf)
    return read


def _mistral_to_ours(hf: dict) -> dict:
    window = hf.get("sliding_window")
    # Mistral's key j is seen by query i when i - j < sliding_window: Megatron's window (sliding_window - 1, 0).
    return dict(_llama_to_ours(hf), window_size=None if window is None else [window - 1, 0])


def _mistral_to_hf(config: ModelConfig) -> dict:
    return dict(_llama_to_hf(config), sliding_window=config.window_size[0] + 1 if config.window_size else None)


def _smollm3_to_ours(hf: dict) -> dict:
    """Llama with NoPE layers: no_rope_layers (1: the layer rotates), by default every no_rope_layer_interval-th
    layer without rotary embeddings; our --no-rope-freq marks the other way round. SmolLM3's defaults differ from
    Llama's: tied embeddings, rope_theta 2e6."""
    refuse(hf.get("use_sliding_window", False), "use_sliding_window (sliding attention on the NoPE layers)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    refuse(layer_types != {"full_attention"}, f"layer_types {sorted(layer_types)} (only full_attention)")
    layers, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    rotates = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    refuse(len(rotates) < layers, f"no_rope_layers of {len(rotates)} entries for {layers} layers")
    nope = [int(not rotate) for rotate in rotates[:layers]]
    fields = _llama_to_ours({"rope_theta": SMOLLM3_THETA, **_set(hf)})
    return dict(fields, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                no_rope_freq=str(nope) if any(nope) else None)  # ModelConfig's spelling


def _smollm3_to_hf(config: ModelConfig) -> dict:
    return dict(_llama_to_hf(config), attention_bias=False, mlp_bias=False, use_sliding_window=False,
                no_rope_layers=[int(not config.is_nope_layer(i)) for i in range(config.num_layers)],
                layer_types=["full_attention"] * config.num_layers)


SMOLLM3_THETA = 2_000_000.0  # SmolLM3Config's rope_theta where config.json leaves it out


def _phi3_to_ours(hf: dict) -> dict:
    refuse(hf.get("resid_pdrop", 0.0) != hf.get("embd_pdrop", 0.0),
           "embd_pdrop different from resid_pdrop (our --hidden-dropout is both)")
    # Mistral's fields, but RoPE read again to take partial_rotary_factor, which Mistral refuses.
    fields = dict(_mistral_to_ours({**hf, "rope_parameters": None, "rope_scaling": None}),
                  hidden_dropout=hf.get("resid_pdrop", 0.0))
    return dict(fields, **_rope_to_ours(hf, partial_rotary=True))


def _phi3_to_hf(config: ModelConfig) -> dict:
    fields = dict(_mistral_to_hf(config), resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout)
    fields["rope_parameters"] = dict(fields["rope_parameters"], partial_rotary_factor=config.rotary_percent)
    return fields


def _gemma_to_ours(hf: dict, every: int) -> dict:
    """What Gemma 2 and 3 share; ``every``: the default period of their global layers."""
    refuse(hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
           f"hidden_activation {hf.get('hidden_activation')!r} (GeGLU takes gelu_pytorch_tanh)")
    refuse(hf.get("attention_bias", False), "attention_bias (biases on q, k, v and o_proj)")
    refuse(hf.get("use_bidirectional_attention", False), "use_bidirectional_attention (ours is causal)")
    window, skip_freq = _layer_pattern(hf, every)
    return dict(_llama_to_ours(hf), apply_layernorm_1p=True, post_sublayer_norm=True, scale_embeddings=True,
                geglu=True, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                softmax_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                final_logit_softcapping=hf.get("final_logit_softcapping"),
                window_size=[window - 1, 0], window_attn_skip_freq=skip_freq)


def _layer_pattern(hf: dict, every: int) -> tuple:
    """(sliding_window, --window-attn-skip-freq) of ``layer_types``, which defaults to every ``every``-th layer
    global (Gemma 3's ``sliding_window_pattern``): every Nth layer global, or none. Other patterns, and none
    sliding, are refused."""
    layers = hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern") or every
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(layers)]
    refuse(set(types) - {"sliding_attention", "full_attention"} != set(), f"layer_types {sorted(set(types))}")
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    refuse(len(full) == layers or hf.get("sliding_window") is None, "no sliding_attention layer (layer_types)")
    skip_freq = full[0] + 1 if full else None
    refuse(bool(full) and full != list(range(skip_freq - 1, layers, skip_freq)),
           f"layer_types with global layers {full} (only every Nth layer global: --window-attn-skip-freq)")
    return hf["sliding_window"], skip_freq


def _gemma_to_hf(config: ModelConfig) -> dict:
    fields = {k: v for k, v in _llama_to_hf(config).items() if k != "hidden_act"}
    freq = config.window_attn_skip_freq
    scalar = round(config.softmax_scale ** -2, 6) if config.softmax_scale else config.head_dim
    return dict(fields, hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                attn_logit_softcapping=config.attn_logit_softcapping,
                final_logit_softcapping=config.final_logit_softcapping, sliding_window=config.window_size[0] + 1,
                layer_types=["full_attention" if freq and (i + 1) % freq == 0 else "sliding_attention"
                             for i in range(config.num_layers)])


GEMMA_FIELDS = LLAMA_FIELDS | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                               "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                               "use_bidirectional_attention"}
# Gemma 3's defaults where its config.json leaves them out (transformers' Gemma3TextConfig).
GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA, GEMMA3_EVERY = 1_000_000.0, 10_000.0, 6


def _gemma3_to_ours(hf: dict) -> dict:
    """Gemma 2's fields with a period of 6, q/k norms, and RoPE per layer kind: ``rope_parameters`` holds
    {full_attention: ..., sliding_attention: ...} (transformers 5), or older files give the global layers'
    ``rope_theta`` and ``rope_scaling`` and the local layers' ``rope_local_base_freq``."""
    rope = hf.get("rope_parameters") or {}
    refuse(bool(set(rope) - {"full_attention", "sliding_attention"}),
           f"rope_parameters keys {sorted(set(rope))} (Gemma 3's are per layer kind: full_attention, "
           f"sliding_attention)")
    full = {**(rope.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}  # as transformers merges them
    full.setdefault("rope_theta", hf.get("rope_theta", GEMMA3_GLOBAL_THETA))
    local = dict(rope.get("sliding_attention") or {})
    local_type = local.pop("rope_type", local.pop("type", "default"))
    refuse(local_type != "default" or set(local) - {"rope_theta"} != set(),
           f"rope_parameters.sliding_attention {rope.get('sliding_attention')} (the local layers' RoPE is "
           f"unscaled: rope_type default)")
    fields = _gemma_to_ours({**hf, "rope_parameters": full, "rope_scaling": None}, GEMMA3_EVERY)
    return dict(fields, qk_layernorm=True,
                rotary_base_local=float(local.get("rope_theta", hf.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))))


def _gemma3_to_hf(config: ModelConfig) -> dict:
    local = {"rope_type": "default", "rope_theta": config.rotary_base_local}
    # rope_theta, rope_scaling (Gemma 2's, the global layers') and rope_local_base_freq for transformers < 5
    return dict(_gemma_to_hf(config), rope_local_base_freq=config.rotary_base_local, rope_parameters={
        "full_attention": _rope_to_hf(config)["rope_parameters"], "sliding_attention": local})


# ---------------------------------------------------------------------------------------------
# Mixtures of experts


def _router_to_ours(hf: dict, *, num_experts: int, topk: int, coef: float, moe_layers: list[bool],
                    norm_topk_prob: bool = True) -> dict:
    """The routing fields every MoE family shares: E experts, top-k of a softmax (renormalised over the k,
    ``norm_topk_prob``, or kept as they are: --moe-router-pre-softmax), which layers have experts, and
    transformers' load-balancing loss (pooled over the layers, the module docstring says how)."""
    pattern = "1" if all(moe_layers) else "[" + ",".join(str(int(moe)) for moe in moe_layers) + "]"
    return dict(num_experts=num_experts, moe_router_topk=topk, moe_router_pre_softmax=not norm_topk_prob,
                moe_layer_freq=pattern, moe_router_load_balancing_type="pooled_aux_loss",
                moe_aux_loss_coeff=coef if hf.get("output_router_logits") else 0.0)


def _router_to_hf(config: ModelConfig) -> dict:
    """A model trained here with Megatron-LM's per-layer loss gets the coefficient whose pooled loss weighs
    the layers alike (x L / k: exact for one layer, and where the layers route alike)."""
    coeff, balancing = config.moe_aux_loss_coeff, config.moe_router_load_balancing_type
    if balancing == "aux_loss":
        coeff *= sum(config.is_moe_layer(i) for i in range(config.num_layers)) / config.moe_router_topk
    return {"num_experts_per_tok": config.moe_router_topk, "router_aux_loss_coef": coeff,
            "output_router_logits": coeff > 0 and balancing != "none"}


def _mixtral_to_ours(hf: dict) -> dict:
    refuse(hf.get("router_jitter_noise", 0.0) != 0.0, "router_jitter_noise (multiplicative noise on the router input)")
    layers = hf["num_hidden_layers"]
    return dict(_mistral_to_ours(hf), moe_ffn_hidden_size=hf["intermediate_size"], **_router_to_ours(
        hf, num_experts=hf.get("num_local_experts", 8), topk=hf.get("num_experts_per_tok", 2),
        coef=hf.get("router_aux_loss_coef", 0.001), moe_layers=[True] * layers))


def _mixtral_to_hf(config: ModelConfig) -> dict:
    return dict(_mistral_to_hf(config), **_router_to_hf(config), intermediate_size=config.moe_ffn_hidden_size,
                num_local_experts=config.num_experts, router_jitter_noise=0.0)


def _qwen3_moe_to_ours(hf: dict) -> dict:
    """Qwen3 with experts in layer i when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers,
    dense MLPs (intermediate_size wide) elsewhere; transformers 5 writes num_experts as num_local_experts."""
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    refuse(not any(moe_layers), "no mixture-of-experts layer (decoder_sparse_step, mlp_only_layers): import it as "
           "qwen3")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    return dict(_llama_to_ours(hf), qk_layernorm=True, moe_ffn_hidden_size=hf.get("moe_intermediate_size", 768),
                **_router_to_ours(hf, num_experts=experts, topk=hf.get("num_experts_per_tok", 8),
                                  coef=hf.get("router_aux_loss_coef", 0.001), moe_layers=moe_layers,
                                  norm_topk_prob=hf.get("norm_topk_prob", False)))


def _qwen3_moe_to_hf(config: ModelConfig) -> dict:
    return dict(_llama_to_hf(config), **_router_to_hf(config), attention_bias=False, use_sliding_window=False,
                num_experts=config.num_experts, moe_intermediate_size=config.moe_ffn_hidden_size,
                norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe_layer(i)])


def _olmoe_to_ours(hf: dict) -> dict:
    """Llama with q/k RMSNorms over the whole projections and experts (intermediate_size wide) in every layer."""
    refuse(hf.get("clip_qkv") is not None, "clip_qkv (queries, keys and values clamped)")
    heads = hf["num_attention_heads"]
    refuse(hf.get("head_dim", hf["hidden_size"] // heads) * heads != hf["hidden_size"],
           "head_dim x num_attention_heads other than hidden_size (OLMoE's q_norm is hidden_size wide)")
    return dict(_llama_to_ours({"rms_norm_eps": 1e-5, **hf}), qk_layernorm=True, qk_layernorm_whole_projection=True,
                moe_ffn_hidden_size=hf["intermediate_size"], **_router_to_ours(
                    hf, num_experts=hf.get("num_experts", 64), topk=hf.get("num_experts_per_tok", 8),
                    coef=hf.get("router_aux_loss_coef", 0.01), moe_layers=[True] * hf["num_hidden_layers"],
                    norm_topk_prob=hf.get("norm_topk_prob", False)))


def _olmoe_to_hf(config: ModelConfig) -> dict:
    return dict(_llama_to_hf(config), **_router_to_hf(config), attention_bias=False, clip_qkv=None,
                intermediate_size=config.moe_ffn_hidden_size, num_experts=config.num_experts,
                norm_topk_prob=not config.moe_router_pre_softmax)


ROUTER_FIELDS = frozenset({"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"})


QWEN_WINDOW_FIELDS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})


def _has_experts(num_experts) -> bool:
    return num_experts is not None


# ---------------------------------------------------------------------------------------------
# DeepSeek-V2/V3: multi-latent attention, first dense layers then mixtures of experts


def _deepseek_reader(version: int) -> Callable[[dict], dict]:
    """DeepSeek-V2 or V3's config.json: multi-latent attention, the first first_k_dense_replace layers dense (their
    defaults differ: 0 and 3), then mixtures of experts (``_deepseek_experts``)."""
    def read(hf: dict) -> dict:
        layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace")
        dense = DEEPSEEK_DEFAULTS[version]["first_k_dense_replace"] if dense is None else dense
        heads = hf["num_attention_heads"]
        refuse((hf.get("num_key_value_heads") or heads) != heads,
               f"num_key_value_heads {hf.get('num_key_value_heads')} other than num_attention_heads {heads} "
               f"(multi-latent attention expands keys for every head)")
        refuse(hf.get("attention_bias", False), "attention_bias (biases on q_a_proj, kv_a_proj_with_mqa and o_proj)")
        refuse(hf.get("mlp_bias", False), "mlp_bias")
        latent = dict(multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
                      kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                      qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], qk_layernorm=True,
                      rope_type="rope")
        fields = dict(_llama_to_ours({**hf, "rope_parameters": None, "rope_scaling": None, "head_dim": None}),
                      **latent)
        rope = _rope_to_ours(hf, latent=True)
        refuse(set(rope) - {"rotary_base", "rope_type"} - set(YARN_FIELDS) != set(),
               "rope scaling other than yarn (rope_parameters.rope_type; DeepSeek's attention scales with yarn)")
        if dense < layers:
            fields.update(_deepseek_experts({**DEEPSEEK_DEFAULTS[version], **_set(hf)}, dense, version))
        return dict(fields, **rope)
    return read


# transformers' DeepseekV2Config / DeepseekV3Config defaults, for the fields a config.json leaves out.
DEEPSEEK_DEFAULTS = {
    2: {"first_k_dense_replace": 0, "n_routed_experts": 64, "moe_intermediate_size": 1407, "n_shared_experts": 2,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False},
    3: {"first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "topk_method": "noaux_tc", "norm_topk_prob": True}}


def _set(hf: dict) -> dict:
    return {name: value for name, value in hf.items() if value is not None}


def _deepseek_experts(hf: dict, dense: int, version: int) -> dict:
    """DeepSeek's mixture-of-experts layers (after the first ``dense``), as transformers computes them: V2 the top-k
    of a softmax over all experts as they are (within the groups of highest best score with topk_method
    group_limited_greedy), V3 the top-k of sigmoid scores chosen with e_score_correction_bias (our expert bias)
    within the groups whose best two sum highest, renormalised; both times routed_scaling_factor, plus
    n_shared_experts shared experts as one MLP. transformers computes no load-balancing loss for either."""
    layers, experts, topk = hf["num_hidden_layers"], hf["n_routed_experts"], hf["num_experts_per_tok"]
    width, shared, scale = hf["moe_intermediate_size"], hf.get("n_shared_experts", 0), hf["routed_scaling_factor"]
    groups, group_topk, method = hf.get("n_group"), hf.get("topk_group"), hf["topk_method"]
    fields = dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
                  moe_layer_freq="[" + ",".join(["0"] * dense + ["1"] * (layers - dense)) + "]",
                  moe_shared_expert_intermediate_size=width * shared if shared else None,
                  moe_router_topk_scaling_factor=None if scale == 1.0 else scale, moe_aux_loss_coeff=0.0)
    if version == 3:
        refuse(method != "noaux_tc", f"topk_method {method!r} (DeepSeek-V3's router is noaux_tc)")
        refuse(not hf["norm_topk_prob"], "norm_topk_prob false with sigmoid scores (ours renormalise the top-k)")
        fields.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        if groups not in (None, 1):  # a group scores by its best two: ours by its best topk / topk_group
            refuse(topk != 2 * group_topk, f"num_experts_per_tok {topk} other than twice topk_group {group_topk} "
                                           f"(a group is scored by its best two experts; ours by its best "
                                           f"num_experts_per_tok / topk_group)")
            fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        return fields
    refuse(hf["norm_topk_prob"], "norm_topk_prob true (transformers' DeepseekV2 router does not renormalise)")
    refuse(method not in ("greedy", "group_limited_greedy"), f"topk_method {method!r} (greedy, group_limited_greedy)")
    fields.update(moe_router_pre_softmax=True)
    if method == "group_limited_greedy":
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk, moe_router_group_score="max")
    return fields


def _deepseek_experts_to_hf(config: ModelConfig, version: int) -> dict:
    """Inverse of ``_deepseek_experts`` (a dense model: every layer before first_k_dense_replace)."""
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_layers)]
    if not any(moe_layers):
        return {"first_k_dense_replace": config.num_layers}
    width, shared = config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size
    groups = (config.moe_router_num_groups, config.moe_router_group_topk) if config.moe_router_num_groups else (1, 1)
    fields = {"first_k_dense_replace": moe_layers.index(True), "n_routed_experts": config.num_experts,
              "num_experts_per_tok": config.moe_router_topk, "moe_intermediate_size": width,
              "n_shared_experts": (shared or 0) // width, "routed_scaling_factor": config.moe_router_topk_scaling_factor
              or 1.0, "n_group": groups[0], "topk_group": groups[1]}
    if version == 3:
        return dict(fields, norm_topk_prob=True)
    return dict(fields, norm_topk_prob=False,
                topk_method="group_limited_greedy" if config.moe_router_num_groups else "greedy")


def _deepseek_to_hf(config: ModelConfig, version: int) -> dict:
    fields = {k: v for k, v in _llama_to_hf(config).items() if k != "head_dim"}
    return dict(fields, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_head_dim, qk_rope_head_dim=config.qk_pos_emb_head_dim,
                v_head_dim=config.v_head_dim, num_key_value_heads=config.num_attention_heads, attention_bias=False,
                **_deepseek_experts_to_hf(config, version))


YARN_FIELDS = ("rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int")
# What a DeepSeek config.json sets for its mixture-of-experts layers (``_deepseek_experts``; nothing in a model
# whose layers are all dense; output_router_logits: transformers computes no router loss from them).
DEEPSEEK_MOE_FIELDS = frozenset({
    "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group",
    "topk_group", "num_experts_per_tok", "norm_topk_prob", "output_router_logits", "topk_method"})
DEEPSEEK_FIELDS = LLAMA_FIELDS | DEEPSEEK_MOE_FIELDS | {
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
    "attention_bias", "pretraining_tp",
    "qk_head_dim"}  # qk_nope_head_dim + qk_rope_head_dim, which transformers recomputes (as head_dim)

FAMILIES = {family.model_type: family for family in (
    Family("gpt2", "GPT2LMHeadModel", "gpt2", GPT2_FIELDS, _gpt2_to_ours, _gpt2_to_hf, padding_idx=False),
    # Exported whenever its naming is (hf_interop.hf_architecture: LayerNorm, biases, GELU, rotary embeddings).
    Family("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox", GPT_NEOX_FIELDS, _gpt_neox_to_ours, _gpt_neox_to_hf,
           also=frozenset({"parallel_attention_mlp"}), padding_idx=False),
    Family("llama", "LlamaForCausalLM", "llama", LLAMA_FIELDS | {"attention_bias", "mlp_bias", "pretraining_tp"},
           _without_biases(_llama_to_ours),
           lambda config: dict(_llama_to_hf(config), attention_bias=False, mlp_bias=False)),
    Family("qwen2", "Qwen2ForCausalLM", "llama", LLAMA_FIELDS | QWEN_WINDOW_FIELDS,
           _qwen_attention(lambda hf: dict(_llama_to_ours(hf), add_qkv_bias=True)),
           lambda config: dict(_llama_to_hf(config), use_sliding_window=False),
           features={"add_qkv_bias": True}),
    Family("qwen3", "Qwen3ForCausalLM", "llama", LLAMA_FIELDS | QWEN_WINDOW_FIELDS | {"attention_bias"},
           _qwen_attention(_without_biases(lambda hf: dict(_llama_to_ours(hf), qk_layernorm=True))),
           lambda config: dict(_llama_to_hf(config), attention_bias=False, use_sliding_window=False),
           features={"qk_layernorm": True}),
    Family("mistral", "MistralForCausalLM", "llama", LLAMA_FIELDS | {"sliding_window"}, _mistral_to_ours,
           _mistral_to_hf, features={"window_size": lambda window: window is not None}),
    Family("smollm3", "SmolLM3ForCausalLM", "llama",
           LLAMA_FIELDS | {"attention_bias", "mlp_bias", "pretraining_tp", "use_sliding_window", "sliding_window",
                           "max_window_layers", "no_rope_layers", "no_rope_layer_interval", "layer_types"},
           _without_biases(_smollm3_to_ours), _smollm3_to_hf, features={"no_rope_freq": lambda freq: freq is not None}),
    # Named as Llama but with q/k/v and gate/up fused; exported only when asked for (--hf-model-type phi3).
    Family("phi3", "Phi3ForCausalLM", "phi3",
           LLAMA_FIELDS | {"sliding_window", "resid_pdrop", "embd_pdrop", "partial_rotary_factor",
                           "original_max_position_embeddings"},  # the context longrope scaling starts from
           _phi3_to_ours, _phi3_to_hf),
    Family("mixtral", "MixtralForCausalLM", "mixtral",
           LLAMA_FIELDS | ROUTER_FIELDS | {"sliding_window", "num_local_experts", "router_jitter_noise"},
           _mixtral_to_ours, _mixtral_to_hf, features={"num_experts": _has_experts}, also=frozenset({"window_size"})),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen_moe",
           LLAMA_FIELDS | QWEN_WINDOW_FIELDS | ROUTER_FIELDS | {
               "attention_bias", "num_experts", "num_local_experts", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers"},
           _qwen_attention(_without_biases(_qwen3_moe_to_ours)), _qwen3_moe_to_hf,
           features={"num_experts": _has_experts, "qk_layernorm": True}),
    Family("olmoe", "OlmoeForCausalLM", "qwen_moe",
           LLAMA_FIELDS | ROUTER_FIELDS | {"attention_bias", "clip_qkv", "num_experts", "norm_topk_prob"},
           _without_biases(_olmoe_to_ours), _olmoe_to_hf,
           features={"num_experts": _has_experts, "qk_layernorm": True, "qk_layernorm_whole_projection": True}),
    Family("gemma2", "Gemma2ForCausalLM", "gemma", GEMMA_FIELDS, lambda hf: _gemma_to_ours(hf, every=2),
           _gemma_to_hf, features={"window_size": lambda window: window is not None}),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma",
           GEMMA_FIELDS | {"rope_local_base_freq", "sliding_window_pattern",
                           "_sliding_window_pattern",  # transformers' copy of the pattern, which it does not read
                           "cache_implementation"},  # generation's cache class ("hybrid"): not the model
           _gemma3_to_ours, _gemma3_to_hf, features={"window_size": lambda window: window is not None,
                                                      "qk_layernorm": True,
                                                      "rotary_base_local": lambda base: base is not None}),
    # Multi-token prediction modules (num_nextn_predict_layers) are not part of transformers' forward.
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek",
           DEEPSEEK_FIELDS | {"rope_interleave", "num_nextn_predict_layers"}, _deepseek_reader(3),
           lambda config: dict(_deepseek_to_hf(config, 3), rope_interleave=True, num_nextn_predict_layers=0),
           features={"multi_latent_attention": True, "qk_layernorm": True}, also=frozenset({"num_experts"})),
    # Exported when asked for (--hf-model-type deepseek_v2): V3 computes its dense models, not its experts.
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek", DEEPSEEK_FIELDS | {"mlp_bias"}, _deepseek_reader(2),
           lambda config: dict(_deepseek_to_hf(config, 2), mlp_bias=False)),
)}

# The features only some families have, and the value each takes where it is absent.
_OPTIONAL_FEATURES = {"add_qkv_bias": False, "qk_layernorm": False, "window_size": None, "rotary_base_local": None,
                      "num_experts": None, "qk_layernorm_whole_projection": False, "multi_latent_attention": False,
                      "parallel_attention_mlp": False, "no_rope_freq": None}
# Namings that are Llama's but for their experts' (hf_interop._EXPERT_NAMES): a Llama-like model with experts.
EXPERT_NAMINGS = frozenset({"mixtral", "qwen_moe"})
# Gemma's features (its own weight naming tells it apart on export): no other family describes them.
GEMMA_FEATURES = {"post_sublayer_norm": False, "scale_embeddings": False, "geglu": False, "softmax_scale": None,
                  "attn_logit_softcapping": None, "final_logit_softcapping": None, "window_attn_skip_freq": None}


def model_config_fields_from_hf(hf: dict) -> dict:
    """ModelConfig fields of a ``config.json``; an unknown family, field or variant is refused by name."""
    model_type = hf.get("model_type")
    refuse(model_type == "gemma3", "a vision tower: config.json has model_type 'gemma3' "
           "(Gemma3ForConditionalGeneration). Import its language model alone, model_type gemma3_text "
           "(Gemma3ForCausalLM): the directory of that model, whose config.json is this one's text_config "
           "(docs/model_families.md saves it in four lines of transformers)")
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json has model_type {model_type!r}; megatron_lite imports "
                          f"{', '.join(f'{f.model_type} ({f.architecture})' for f in FAMILIES.values())}.")
    family = FAMILIES[model_type]
    unknown = sorted(k for k, v in hf.items() if v is not None and k not in GENERIC_FIELDS | family.fields)
    refuse(bool(unknown), f"config.json field(s) {', '.join(unknown)} (not read by the {model_type} import)")
    return dict(family.to_ours(hf), vocab_size=hf["vocab_size"], init_method_std=hf.get("initializer_range", 0.02),
                pad_token_id=pad_token_id_from_hf(hf))


def config_json(family: Family, config: ModelConfig) -> dict:
    """The ``config.json`` of ``config`` as a model of ``family``."""
    return {"architectures": [family.architecture], "model_type": family.model_type, **family.to_hf(config),
            "vocab_size": config.vocab_size, "initializer_range": config.init_method_std, "dtype": "float32",
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            # The imported model's, else unset unless a tokenizer names one: Phi3Config's default (32000) is past a
            # small vocabulary.
            "pad_token_id": config.pad_token_id}


def named_family(config: ModelConfig, model_type: str) -> Family:
    """The family ``model_type`` (--hf-model-type), if its config.json can describe ``config`` exactly: the
    model read back from it must compute what ``config`` computes."""
    if model_type not in FAMILIES:
        raise ConfigError(f"--hf-model-type {model_type!r}: one of {', '.join(FAMILIES)}.")
    family = FAMILIES[model_type]
    back = model_config_fields_from_hf(config_json(family, config))
    differences = sorted(name for name, value in back.items()
                         if defines_function(name, config) and getattr(config, name) != value)
    others = [name for name, absent in {**_OPTIONAL_FEATURES, **GEMMA_FEATURES}.items()
              if name not in back and getattr(config, name) != absent]
    if differences or others:
        raise ConfigError(f"--hf-model-type {model_type} cannot describe this model: it differs in "
                          f"{', '.join(differences + others)}.")
    return family


def family_of(config: ModelConfig, naming: str) -> Family:
    """The family to export ``config`` as: of those with its weight ``naming`` (a Llama-like model's experts
    may be named as any family's), the one whose features are exactly the model's optional features (none of
    them: GPT-2 or Llama)."""
    present = {name for name, absent in _OPTIONAL_FEATURES.items() if getattr(config, name) != absent}
    for family in FAMILIES.values():
        family_naming = "llama" if family.naming in EXPERT_NAMINGS else family.naming
        if family_naming == naming and set(family.features) <= present <= set(family.features) | family.also and all(
                test(getattr(config, name)) if callable(test) else getattr(config, name) == test
                for name, test in family.features.items()):
            return family
    raise ConfigError(f"no Hugging Face family has this model's combination of "
                      f"{', '.join(sorted(present))}: export needs at most one of --add-qkv-bias (Qwen2), "
                      f"--qk-layernorm (Qwen3) and --window-size (Mistral), or Gemma's features with "
                      f"--window-size (Gemma 2) or with --window-size, --qk-layernorm and --rotary-base-local "
                      f"(Gemma 3), or --num-experts with or without --window-size (Mixtral), with --qk-layernorm "
                      f"(Qwen3-MoE) or with --qk-layernorm and --qk-layernorm-whole-projection (OLMoE), or "
                      f"--multi-latent-attention with --qk-layernorm (DeepSeek); --parallel-attention-mlp only with "
                      f"GPT-NeoX's LayerNorm, biases, GELU and rotary embeddings.")
