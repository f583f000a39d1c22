"""OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``): Llama with the norms after the sublayers
instead of before (x + Norm(Attn(x)): --post-sublayer-norm --no-pre-sublayer-norm) and q/k RMSNorms over the
whole projections (OLMoE's, --qk-layernorm-whole-projection); OLMo 3 adds sliding-window layers, every fourth
layer global by default, and RoPE per layer kind."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse
from megatron_lite.interop.hf.gemma import layer_pattern
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours
from megatron_lite.interop.hf.rope import rope_to_hf

# The norms and q/k norms both OLMos have.
OLMO_NORMS = {"post_sublayer_norm": True, "no_pre_sublayer_norm": True, "qk_layernorm": True,
              "qk_layernorm_whole_projection": True}


def _olmo2_to_ours(hf: dict) -> dict:
    """Llama (rms_norm_eps 1e-5, untied embeddings: Olmo2Config's defaults) with OLMo's norms."""
    refuse(hf.get("attention_bias", False), "attention_bias (biases on q, k, v and o_proj)")
    return dict(llama_to_ours({"rms_norm_eps": 1e-5, **hf}), **OLMO_NORMS)


def _olmo2_to_hf(config: ModelConfig) -> dict:
    return dict(llama_to_hf(config), attention_bias=False)


OLMO_FIELDS = LLAMA_FIELDS | {"attention_bias"}
OLMO2 = Family("olmo2", "Olmo2ForCausalLM", "olmo2", OLMO_FIELDS, _olmo2_to_ours, _olmo2_to_hf,
               features={"qk_layernorm": True, "qk_layernorm_whole_projection": True, "no_pre_sublayer_norm": True})


# Olmo3Config's defaults where its config.json leaves them out.
OLMO3_THETA, OLMO3_EVERY = 500_000.0, 4


def _olmo3_to_ours(hf: dict) -> dict:
    """OLMo 2 with sliding-window layers (layer_types, by default every fourth layer global) and RoPE per layer
    kind: ``rope_parameters`` {full_attention: ..., sliding_attention: ...} (transformers 5), or older files'
    rope_theta (the default only, which both versions read alike) and rope_scaling for the global layers. Local
    layers rotating as the global ones do need nothing more; unscaled under scaled global layers, they take
    --rotary-base-local (never scaled)."""
    rope = dict(hf.get("rope_parameters") or {})
    refuse(bool(set(rope) - {"full_attention", "sliding_attention"}),
           f"rope_parameters keys {sorted(set(rope))} (OLMo 3's are per layer kind: full_attention, "
           f"sliding_attention)")
    theta = hf.get("rope_theta", OLMO3_THETA)
    refuse(theta != OLMO3_THETA and not rope.get("sliding_attention"),
           f"rope_theta {theta} without rope_parameters.sliding_attention (transformers 4 rotates every layer by it, "
           f"transformers 5 the global layers only, the local ones by {OLMO3_THETA:g}: give rope_parameters per "
           f"layer kind)")
    full = {"rope_theta": theta, **(rope.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    local = {"rope_theta": theta, **(rope.get("sliding_attention") or {"rope_type": "default"})}
    fields = _olmo2_to_ours({**hf, "rope_parameters": full, "rope_scaling": None})
    window, skip_freq = layer_pattern(hf, OLMO3_EVERY)
    fields.update(window_size=[window - 1, 0], window_attn_skip_freq=skip_freq)
    if _same_rope(local, full):
        return fields
    refuse(local.pop("rope_type", local.pop("type", "default")) != "default" or set(local) != {"rope_theta"},
           f"rope_parameters.sliding_attention {rope.get('sliding_attention')} (the local layers rotate as the "
           f"global ones, or unscaled: rope_type default)")
    return dict(fields, rotary_base_local=float(local["rope_theta"]))


def _same_rope(local: dict, full: dict) -> bool:
    def canonical(rope: dict) -> dict:
        rope = dict(rope)
        return dict(rope, rope_type=rope.pop("type", rope.get("rope_type", "default")))
    return canonical(local) == canonical(full)


def _olmo3_to_hf(config: ModelConfig) -> dict:
    full = rope_to_hf(config)["rope_parameters"]
    local = full if config.rotary_base_local is None else {"rope_type": "default",
                                                           "rope_theta": config.rotary_base_local}
    freq = config.window_attn_skip_freq
    return dict(_olmo2_to_hf(config), rope_parameters={"full_attention": full, "sliding_attention": local},
                sliding_window=config.window_size[0] + 1,
                layer_types=["full_attention" if freq and (i + 1) % freq == 0 else "sliding_attention"
                             for i in range(config.num_layers)])


OLMO3 = Family("olmo3", "Olmo3ForCausalLM", "olmo2", OLMO_FIELDS | {"sliding_window", "layer_types"},
               _olmo3_to_ours, _olmo3_to_hf,
               features={**OLMO2.features, "window_size": lambda window: window is not None},
               also=frozenset({"rotary_base_local"}))
