"""The Hugging Face model families megatron_lite imports and exports, each a spec of ``config.json``.

A family is its ``model_type``, the transformers class that loads it, how its weights are named
(``naming``: GPT-2's, Llama's, Phi-3's, Gemma's or DeepSeek's, or Llama's with Mixtral's or Qwen-MoE's
expert names, ``weights``), the ModelConfig features it implies, and every ``config.json`` field it
reads: one module per family, or per kin of families (``gpt2``, ``llama``, ``qwen``, ...). A field outside
that list (and outside ``GENERIC_FIELDS``, which change nothing we compute) is refused by name at import,
never dropped: an unread field is a silently different model. A null field sets nothing and passes.

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
    glm4_moe llama + q/k/v biases (attention_bias),    norm_topk_prob false, groups other than
             q/k RMSNorm (use_qk_norm), RoPE on         scored by their best two, rope scaling
             partial_rotary_factor of each head (0.5   other than linear, llama3, yarn
             unless set), first_k_dense_replace dense
             layers, then deepseek_v3's experts (shared
             experts, sigmoid, expert bias, groups)
    olmo2    llama + norms after the sublayers, none   attention_bias
             before (--post-sublayer-norm
             --no-pre-sublayer-norm), q/k RMSNorm over
             the whole projection (olmoe's)
    olmo3    olmo2 + sliding / global layers (every    olmo2's; layer_types other than every Nth
             4th global by default), RoPE per layer    layer global, rope_parameters.
             kind (the local layers' unscaled:         sliding_attention scaled other than as the
             --rotary-base-local)                      global layers
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
    gpt_oss  llama + biases on q/k/v/o, a learned sink  attention_bias false, swiglu_alpha other than
             per head (--softmax-type learnable),      1.702, layer_types other than every Nth layer
             sliding / global layers (layer_types),     global, quantization_config (MXFP4: import a
             YaRN, experts in every layer: router and   dequantised copy)
             expert biases, top-k of the logits then
             their softmax, the experts' clamped gated
             unit (--quick-geglu, --glu-linear-offset
             1, --activation-func-clamp-value
             swiglu_limit)

    llama4_text  llama + NoPE layers (smollm3's fields),  attention_bias, hidden_act other than silu,
             chunked attention on the others             num_experts_per_tok other than 1, layer_types
             (attention_chunk_size: --attention-chunk-   other than chunked on exactly the RoPE layers,
             size), q/k L2 norms there (use_qk_norm:      rope_type yarn, no MoE layer, for_llm_compressor
             --qk-l2-norm), the NoPE layers' temperature
             (attn_temperature_tuning, floor_scale,
             attn_scale), interleaved rotary rows, llama3
             RoPE with its own frequency factors; experts
             where moe_layers says (dense MLPs
             intermediate_size_mlp wide elsewhere): the
             top-1 logit's sigmoid on the expert's input
             (--moe-apply-probs-on-input), a shared expert

    qwen3_next, qwen3_5_text (qwen3_next.py):
             hybrid layers: gated DeltaNet (layer_types    layer_types other than linear_attention and
             linear_attention: --experimental-attention-   full_attention, attention_bias, mlp_bias, other
             variant gdn, --linear-attention-freq) and     rope types than llama's
             gated attention (--attention-output-gate)
             with q/k (1 + w) RMSNorms and partial RoPE;
             (1 + w) RMSNorms; qwen3_next: experts as
             qwen3_moe's with a sigmoid-gated shared
             expert; qwen3_5_text: dense, unfused
             DeltaNet projections

DeepSeek-V3's and GLM-4.5's multi-token prediction layers (num_nextn_predict_layers: --mtp-num-layers) are extra
decoder layers in their files: ``multi_token_prediction``.

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

from megatron_lite.checkpointing.architecture import defines_function
from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.interop.hf import (deepseek, gemma, glm4_moe, gpt2, gpt_neox, gpt_oss, llama, llama4, mistral,
                                      mixtral, olmo, olmoe, phi3, qwen, qwen3_next, smollm3)
from megatron_lite.interop.hf.family import GENERIC_FIELDS, Family, refuse
from megatron_lite.interop.hf.pad_token import pad_token_id_from_hf

# In the order an export looks for the family of a model's features (``family_of``): the first that fits.
FAMILIES = {family.model_type: family for family in (
    gpt2.GPT2,
    gpt_neox.GPT_NEOX,
    llama.LLAMA,
    qwen.QWEN2,
    qwen.QWEN3,
    mistral.MISTRAL,
    smollm3.SMOLLM3,
    phi3.PHI3,
    mixtral.MIXTRAL,
    qwen.QWEN3_MOE,
    olmoe.OLMOE,
    glm4_moe.GLM4_MOE,
    olmo.OLMO2,
    olmo.OLMO3,
    gemma.GEMMA2,
    gemma.GEMMA3_TEXT,
    deepseek.DEEPSEEK_V3,
    deepseek.DEEPSEEK_V2,
    gpt_oss.GPT_OSS,
    llama4.LLAMA4_TEXT,
    qwen3_next.QWEN3_NEXT,
    qwen3_next.QWEN3_5,
)}

# The features only some families have, and the value each takes where it is absent.
_OPTIONAL_FEATURES = {"add_qkv_bias": False, "qk_layernorm": False, "window_size": None, "rotary_base_local": None,
                      "num_experts": None, "qk_layernorm_whole_projection": False, "multi_latent_attention": False,
                      "parallel_attention_mlp": False, "no_rope_freq": None, "mtp_num_layers": None,
                      "softmax_type": "vanilla", "quick_geglu": False, "glu_linear_offset": 0.0,
                      "activation_func_clamp_value": None, "experimental_attention_variant": None,
                      "attention_output_gate": False, "no_pre_sublayer_norm": False, "attention_chunk_size": None,
                      "qk_l2_norm": False, "attn_temperature_tuning": False, "moe_apply_probs_on_input": False}
# Namings that are Llama's but for their experts' (weights._EXPERT_NAMES): a Llama-like model with experts.
EXPERT_NAMINGS = frozenset({"mixtral", "qwen_moe", "glm4_moe", "llama4"})


# Gemma's features (its own weight naming tells it apart on export): no other family describes them.
GEMMA_FEATURES = {"post_sublayer_norm": False, "scale_embeddings": False, "geglu": False, "softmax_scale": None,
                  "attn_logit_softcapping": None, "final_logit_softcapping": None, "window_attn_skip_freq": None}


def model_config_fields_from_hf(hf: dict) -> dict:
    """ModelConfig fields of a ``config.json``; an unknown family, field or variant is refused by name."""
    model_type = hf.get("model_type")
    refuse(model_type == "llama4", "a vision tower: config.json has model_type 'llama4' "
           "(Llama4ForConditionalGeneration). Import its language model alone, model_type llama4_text "
           "(Llama4ForCausalLM): the directory of that model, whose config.json is this one's text_config "
           "(docs/model_families.md saves it with transformers)")
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
                      f"(Qwen3-MoE) or with --qk-layernorm and --qk-layernorm-whole-projection (OLMoE), OLMo's norms "
                      f"(--post-sublayer-norm --no-pre-sublayer-norm) with those q/k norms and maybe --window-size, or "
                      f"--multi-latent-attention with --qk-layernorm (DeepSeek), or --softmax-type learnable with "
                      f"--num-experts, --quick-geglu, --glu-linear-offset 1 and --activation-func-clamp-value "
                      f"(gpt-oss), or --num-experts with --moe-apply-probs-on-input and maybe --no-rope-freq, "
                          f"--attention-chunk-size, --qk-l2-norm and --attn-temperature-tuning (Llama 4); "
                          f"--parallel-attention-mlp only with GPT-NeoX's LayerNorm, biases, GELU and rotary "
                      f"embeddings.")
