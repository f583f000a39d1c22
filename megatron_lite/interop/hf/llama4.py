"""Llama 4's text model (``Llama4ForCausalLM``, model_type llama4_text): Llama's norms, SwiGLU and grouped-query
attention, with

- NoPE layers: no_rope_layers, or every no_rope_layer_interval-th layer (--no-rope-freq, read as SmolLM3's);
- chunked local attention on the other layers (attention_chunk_size: --attention-chunk-size; layer_types must say
  the same), global attention on the NoPE layers;
- q/k L2 norms on the layers with rotary embeddings (use_qk_norm: --qk-l2-norm);
- the NoPE layers' queries scaled by a temperature growing with their position (attn_temperature_tuning, floor_scale,
  attn_scale: --attn-temperature-tuning, --attn-temperature-floor-scale, --attn-temperature-scale);
- RoPE in its complex-number form, rotating interleaved channel pairs: q_proj's and k_proj's rows are reordered to
  our halves (``llama4_weights``), and its llama3 scaling with Llama 4 Scout's frequency factors (low and high 1);
- experts on the layers moe_layers names (by default every interleave_moe_layer_step-th), dense MLPs
  intermediate_size_mlp wide on the others: the router's top-1 logit, whose sigmoid scales the expert's input, not
  its output (--moe-router-score-function sigmoid --moe-apply-probs-on-input), beside a shared expert as wide as the
  experts (intermediate_size).

transformers' Llama4ForCausalLM trains with no load-balancing loss: router_aux_loss_coef and output_router_logits
change nothing it computes, nor does router_jitter_noise (read by no module) or cache_implementation (generation's
cache): all four are accepted, and the import trains without one too. Refused: attention_bias, a hidden_act other
than silu, a top-k other than 1 (the sigmoid of a top-k of more is not renormalised, as ours would), layer_types
other than chunked on exactly the RoPE layers, rope_type yarn (its concentration of the rotated channels, which
transformers' q/k norm divides away again), and a model without experts. A multimodal Llama 4 (model_type llama4) is
refused with how to import its language model.
"""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.experts import has_experts
from megatron_lite.interop.hf.family import Family, refuse, set_fields
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours
from megatron_lite.interop.hf.smollm3 import no_rope_freq, no_rope_layers, nope_layers

# transformers' Llama4TextConfig defaults where they matter and differ from Llama's (a config.json may leave them out).
LLAMA4_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                   "max_position_embeddings": 131072,
                   "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
                   "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                   "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}
LLAMA4_CHUNK = 8192  # attention_chunk_size where config.json leaves it out (null: no chunked layer)


def _chunks(chunk: int | None, layer_types: list | None, nope: list[bool]) -> dict:
    """--attention-chunk-size, where a layer is chunked: layer_types must chunk exactly the RoPE layers (its
    default), the NoPE layers attending to everything."""
    kinds = ["full_attention" if no_rope or chunk is None else "chunked_attention" for no_rope in nope]
    given = layer_types or kinds
    refuse(given != kinds, f"layer_types {given} (chunked_attention on exactly the layers with rotary embeddings, "
                           f"attention_chunk_size {chunk}: {kinds})")
    return {"attention_chunk_size": chunk} if "chunked_attention" in kinds else {}


def _temperature(hf: dict, nope: list[bool]) -> dict:
    """The NoPE layers' temperature tuning (where there are NoPE layers for it to act on)."""
    if not (hf["attn_temperature_tuning"] and any(nope)):  # released configs write it as 4: a truth value
        return {}
    return dict(attn_temperature_tuning=True, attn_temperature_floor_scale=int(hf["floor_scale"]),
                attn_temperature_scale=float(hf["attn_scale"]))


def _experts(hf: dict) -> dict:
    layers, step = hf["num_hidden_layers"], hf["interleave_moe_layer_step"]
    moe_layers = hf.get("moe_layers")
    moe_layers = set(range(step - 1, layers, step) if moe_layers is None else moe_layers)
    pattern = [i in moe_layers for i in range(layers)]
    refuse(not any(pattern), "no mixture-of-experts layer (moe_layers, interleave_moe_layer_step): a dense model, "
                             "which no released Llama 4 is")
    topk = hf["num_experts_per_tok"]
    refuse(topk != 1, f"num_experts_per_tok {topk} (each expert's input scaled by its unnormalised sigmoid: "
                      f"--moe-apply-probs-on-input takes the top 1 only)")
    width = hf["intermediate_size"]
    return dict(num_experts=hf["num_local_experts"], moe_router_topk=1, moe_router_score_function="sigmoid",
                moe_apply_probs_on_input=True, moe_ffn_hidden_size=width, moe_shared_expert_intermediate_size=width,
                moe_layer_freq="1" if all(pattern) else str([int(moe) for moe in pattern]),  # ModelConfig's spelling
                moe_aux_loss_coeff=0.0)


def _llama4_to_ours(hf: dict) -> dict:
    refuse(hf.get("attention_bias", False), "attention_bias (biases on q, k, v and o_proj)")
    refuse(bool(hf.get("for_llm_compressor")), "for_llm_compressor (experts stored as one linear layer each)")
    chunk = hf.get("attention_chunk_size", LLAMA4_CHUNK)  # null is no chunking, not the default
    hf = {**LLAMA4_DEFAULTS, **set_fields(hf)}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    refuse(rope.get("rope_type", rope.get("type")) == "yarn",
           "rope_type yarn (its concentration of the rotated channels, which transformers' Llama 4 divides away "
           "again with its q/k norm)")
    nope = nope_layers(hf)
    fields = llama_to_ours({**hf, "intermediate_size": hf["intermediate_size_mlp"]})  # the dense MLPs'
    return dict(fields, no_rope_freq=no_rope_freq(nope), qk_l2_norm=bool(hf["use_qk_norm"]),
                **_chunks(chunk, hf.get("layer_types"), nope),
                **_temperature(hf, nope), **_experts(hf),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False))


def _llama4_to_hf(config: ModelConfig) -> dict:
    layers = range(config.num_layers)
    chunked = [config.attention_chunk_size is not None and not config.is_nope_layer(i) for i in layers]
    return dict(llama_to_hf(config), attention_bias=False, intermediate_size=config.moe_ffn_hidden_size,
                intermediate_size_mlp=config.ffn_hidden_size, num_local_experts=config.num_experts,
                num_experts_per_tok=config.moe_router_topk, moe_layers=[i for i in layers if config.is_moe_layer(i)],
                no_rope_layers=no_rope_layers(config), use_qk_norm=config.qk_l2_norm,
                attention_chunk_size=config.attention_chunk_size,
                layer_types=["chunked_attention" if chunk else "full_attention" for chunk in chunked],
                attn_temperature_tuning=config.attn_temperature_tuning,
                floor_scale=config.attn_temperature_floor_scale, attn_scale=config.attn_temperature_scale)


LLAMA4_FIELDS = LLAMA_FIELDS | {
    "attention_bias", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
    "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size",
    "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale", "router_aux_loss_coef",
    "output_router_logits", "router_jitter_noise", "cache_implementation", "for_llm_compressor"}

# Export picks it for a model routing as Llama 4 does; its attention's features are its own too.
LLAMA4_TEXT = Family("llama4_text", "Llama4ForCausalLM", "llama4", LLAMA4_FIELDS, _llama4_to_ours, _llama4_to_hf,
                     features={"num_experts": has_experts, "moe_apply_probs_on_input": True},
                     also=frozenset({"no_rope_freq", "attention_chunk_size", "qk_l2_norm", "attn_temperature_tuning"}))
