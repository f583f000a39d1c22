"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's language model (``Gemma3ForCausalLM``): RMSNorm (1 + w),
post-sublayer norms, a scaled embedding, GeGLU, soft-capping and sliding / global layers."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours
from megatron_lite.interop.hf.rope import rope_to_hf


def _gemma_to_ours(hf: dict, every: int) -> dict:
    """What Gemma 2 and 3 share; ``every``: the default period of their global layers."""
    refuse(hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
           f"hidden_activation {hf.get('hidden_activation')!r} (GeGLU takes gelu_pytorch_tanh)")
    refuse(hf.get("attention_bias", False), "attention_bias (biases on q, k, v and o_proj)")
    refuse(hf.get("use_bidirectional_attention", False), "use_bidirectional_attention (ours is causal)")
    window, skip_freq = sliding_layer_pattern(hf, every)
    return dict(llama_to_ours(hf), apply_layernorm_1p=True, post_sublayer_norm=True, scale_embeddings=True,
                geglu=True, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                softmax_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                final_logit_softcapping=hf.get("final_logit_softcapping"),
                window_size=[window - 1, 0], window_attn_skip_freq=skip_freq)


def sliding_layer_pattern(hf: dict, every: int) -> tuple:
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
    fields = {k: v for k, v in llama_to_hf(config).items() if k != "hidden_act"}
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
        "full_attention": rope_to_hf(config)["rope_parameters"], "sliding_attention": local})


GEMMA2 = Family("gemma2", "Gemma2ForCausalLM", "gemma", GEMMA_FIELDS, lambda hf: _gemma_to_ours(hf, every=2),
                _gemma_to_hf, features={"window_size": lambda window: window is not None})

GEMMA3_TEXT = Family(
    "gemma3_text", "Gemma3ForCausalLM", "gemma",
    GEMMA_FIELDS | {"rope_local_base_freq", "sliding_window_pattern",
                    "_sliding_window_pattern",  # transformers' copy of the pattern, which it does not read
                    "cache_implementation"},  # generation's cache class ("hybrid"): not the model
    _gemma3_to_ours, _gemma3_to_hf, features={"window_size": lambda window: window is not None, "qk_layernorm": True,
                                              "rotary_base_local": lambda base: base is not None})
