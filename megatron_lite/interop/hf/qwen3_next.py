"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5's language model (``Qwen3_5ForCausalLM``): hybrid layers of
gated DeltaNet linear attention and gated softmax attention (docs/model_families.md).

    layer_types              linear_attention / full_attention per layer (else every full_attention_interval-th,
                             default 4, is full): --experimental-attention-variant gdn --linear-attention-freq
                             with the list, 1 for a linear-attention layer
    full attention           Qwen3's q/k RMSNorm with a gate per query channel (q_proj rows [q_h; gate_h] per
                             head: --attention-output-gate), RoPE on partial_rotary_factor of each head (default
                             0.25: --rotary-percent)
    every RMSNorm            (1 + w), weights stored zero-centred as ours with --apply-layernorm-1p (not the
                             gated norm after the DeltaNet, whose weight is the scale)
    Qwen3-Next's MoE         experts where decoder_sparse_step and mlp_only_layers put them (as Qwen3-MoE), a
                             shared expert (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate):
                             --moe-shared-expert-gate
    Qwen3.5                  dense MLPs; the DeltaNet's projections unfused (in_proj_qkv, in_proj_z, in_proj_b,
                             in_proj_a); rope_parameters' mrope_section and mrope_interleaved read and dropped (the
                             text's positions are the same on every M-RoPE axis, so M-RoPE is RoPE)

Weights: the DeltaNet's projections become our one ``in_proj``, laid out per key head ([q, k, v, z, b, a] of the
key head and its value heads: Qwen3-Next's in_proj_qkvz and in_proj_ba are already per key head), and the
convolution's channels [all q; all k; all v] become per key head [q, k, v], so a tensor-parallel shard holds
whole heads (``model/gated_delta_net.py``).
"""
from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.experts import ROUTER_FIELDS, router_to_hf, router_to_ours
from megatron_lite.interop.hf.family import Family, refuse, without_biases
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours
from megatron_lite.interop.hf.rope import rope_to_ours

LAYER_TYPES = ("linear_attention", "full_attention")
# Qwen3NextConfig's and Qwen3_5TextConfig's defaults where config.json leaves a field out.
LINEAR_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32}
PARTIAL_ROTARY_FACTOR = 0.25
HYBRID_FIELDS = LLAMA_FIELDS | frozenset(LINEAR_DEFAULTS) | {"attention_bias", "partial_rotary_factor", "layer_types",
                                                             "full_attention_interval"}
MOE_FIELDS = ROUTER_FIELDS | {"decoder_sparse_step", "mlp_only_layers", "num_experts", "moe_intermediate_size",
                              "shared_expert_intermediate_size", "norm_topk_prob"}


def _hybrid_to_ours(hf: dict) -> dict:
    """What Qwen3-Next and Qwen3.5 share: the layer pattern, the DeltaNet's sizes, gated attention with q/k norms,
    partial RoPE and zero-centred norms."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    kinds = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % interval == 0] for i in range(layers)]
    refuse(len(kinds) != layers, f"layer_types of {len(kinds)} entries for {layers} layers")
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    refuse(bool(unknown), f"layer_types {unknown} (only linear_attention and full_attention)")
    linear = [int(kind == "linear_attention") for kind in kinds]
    rope = dict(hf.get("rope_parameters") or {})
    for axes in ("mrope_section", "mrope_interleaved"):  # Qwen3.5's M-RoPE: RoPE for text (module docstring)
        rope.pop(axes, None)
    # Llama's fields, RoPE read apart (Llama refuses a partial rotary factor).
    fields = llama_to_ours({**{k: v for k, v in hf.items() if k != "partial_rotary_factor"}, "rope_parameters": None,
                            "rope_scaling": None})
    rotary = rope_to_ours({"partial_rotary_factor": PARTIAL_ROTARY_FACTOR, **hf, "rope_parameters": rope or None},
                          partial_rotary=True)
    return dict(fields, **rotary, apply_layernorm_1p=True, qk_layernorm=True, attention_output_gate=True,
                experimental_attention_variant="gdn" if any(linear) else None,
                linear_attention_freq=str(linear) if any(linear) else None,
                **{name: hf.get(name, default) for name, default in LINEAR_DEFAULTS.items()})


def _qwen3_next_to_ours(hf: dict) -> dict:
    """The hybrid layers, and experts in layer i when num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is
    not in mlp_only_layers (dense MLPs, intermediate_size wide, elsewhere), each MoE layer with its gated shared
    expert."""
    fields = _hybrid_to_ours(hf)
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    experts, dense = hf.get("num_experts", 512), set(hf.get("mlp_only_layers") or [])
    moe_layers = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if not any(moe_layers):
        return fields
    return dict(fields, moe_ffn_hidden_size=hf.get("moe_intermediate_size", 512),
                moe_shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 512),
                moe_shared_expert_gate=True,
                **router_to_ours(hf, num_experts=experts, topk=hf.get("num_experts_per_tok", 10),
                                 coef=hf.get("router_aux_loss_coef", 0.001), moe_layers=moe_layers,
                                 norm_topk_prob=hf.get("norm_topk_prob", True)))


def _hybrid_to_hf(config: ModelConfig) -> dict:
    fields = llama_to_hf(config)
    fields["rope_parameters"] = dict(fields["rope_parameters"], partial_rotary_factor=config.rotary_percent)
    return dict(fields, attention_bias=False,
                layer_types=[LAYER_TYPES[not config.is_linear_attention_layer(i)] for i in range(config.num_layers)],
                **{name: getattr(config, name) for name in LINEAR_DEFAULTS})


def _qwen3_next_to_hf(config: ModelConfig) -> dict:
    if config.num_experts is None:
        return dict(_hybrid_to_hf(config), num_experts=0, mlp_only_layers=[])
    return dict(_hybrid_to_hf(config), **router_to_hf(config), num_experts=config.num_experts,
                moe_intermediate_size=config.moe_ffn_hidden_size, norm_topk_prob=not config.moe_router_pre_softmax,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size, decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe_layer(i)])


HYBRID_FEATURES = {"experimental_attention_variant": "gdn", "attention_output_gate": True, "qk_layernorm": True}

QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", "qwen3_next", HYBRID_FIELDS | MOE_FIELDS,
                    without_biases(_qwen3_next_to_ours), _qwen3_next_to_hf, features=HYBRID_FEATURES,
                    also=frozenset({"num_experts"}))

# Exported only when imported as one, or asked for (--hf-model-type qwen3_5_text): Qwen3-Next names the same model.
QWEN3_5 = Family("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen3_5", HYBRID_FIELDS, without_biases(_hybrid_to_ours),
                 _hybrid_to_hf, features=HYBRID_FEATURES)


# ---------------------------------------------------------------------------------------------
# The DeltaNet's weights

def _sizes(config: ModelConfig) -> tuple:
    heads = config.linear_num_key_heads
    per_key = config.linear_num_value_heads // heads
    return heads, config.linear_key_head_dim, per_key * config.linear_value_head_dim, per_key


def gated_delta_net_from_hf(take, theirs: str, layer: str, config: ModelConfig, naming: str) -> dict:
    """Layer ``theirs``' linear_attn tensors (``take(name)``) -> ours under ``layer``."""
    heads, key_dim, values, gates = _sizes(config)
    hf, ours = theirs + "linear_attn.", layer + "self_attention."
    if naming == "qwen3_next":  # both already per key head
        blocks = [take(hf + "in_proj_qkvz.weight").view(heads, 2 * key_dim + 2 * values, -1),
                  take(hf + "in_proj_ba.weight").view(heads, 2 * gates, -1)]
    else:
        query, key, value = take(hf + "in_proj_qkv.weight").split([heads * key_dim, heads * key_dim, heads * values])
        blocks = [query.view(heads, key_dim, -1), key.view(heads, key_dim, -1), value.view(heads, values, -1),
                  take(hf + "in_proj_z.weight").view(heads, values, -1),
                  take(hf + "in_proj_b.weight").view(heads, gates, -1),
                  take(hf + "in_proj_a.weight").view(heads, gates, -1)]
    conv = take(hf + "conv1d.weight")
    conv_blocks = [part.reshape(heads, -1, *conv.shape[1:]) for part in
                   conv.split([heads * key_dim, heads * key_dim, heads * values])]
    return {ours + "in_proj.weight": torch.cat(blocks, dim=1).flatten(0, 1),
            ours + "conv1d.weight": torch.cat(conv_blocks, dim=1).flatten(0, 1),
            ours + "A_log": take(hf + "A_log"), ours + "dt_bias": take(hf + "dt_bias"),
            ours + "out_norm.weight": take(hf + "norm.weight"), ours + "out_proj.weight": take(hf + "out_proj.weight")}


def gated_delta_net_to_hf(read, theirs: str, layer: str, config: ModelConfig, naming: str) -> dict:
    """Inverse of ``gated_delta_net_from_hf``."""
    heads, key_dim, values, gates = _sizes(config)
    hf, ours = theirs + "linear_attn.", layer + "self_attention."
    in_proj = read(ours + "in_proj.weight")
    query, key, value, z, b, a = in_proj.view(heads, -1, in_proj.shape[-1]).split(
        [key_dim, key_dim, values, values, gates, gates], dim=1)
    if naming == "qwen3_next":
        projections = {"in_proj_qkvz": torch.cat([query, key, value, z], dim=1),
                       "in_proj_ba": torch.cat([b, a], dim=1)}
    else:
        projections = {"in_proj_qkv": torch.cat([query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1)]),
                       "in_proj_z": z, "in_proj_b": b, "in_proj_a": a}
    conv = read(ours + "conv1d.weight")
    conv_q, conv_k, conv_v = conv.view(heads, -1, *conv.shape[1:]).split([key_dim, key_dim, values], dim=1)
    return {**{f"{hf}{name}.weight": weight.flatten(0, 1) if weight.dim() == 3 else weight
               for name, weight in projections.items()},
            hf + "conv1d.weight": torch.cat([conv_q.flatten(0, 1), conv_k.flatten(0, 1), conv_v.flatten(0, 1)]),
            hf + "A_log": read(ours + "A_log"), hf + "dt_bias": read(ours + "dt_bias"),
            hf + "norm.weight": read(ours + "out_norm.weight"), hf + "out_proj.weight": read(ours + "out_proj.weight")}
