"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``): Llama's attention with biases on q, k and v (attention_bias:
--add-qkv-bias; o_proj has none), per-head q/k RMSNorm before the rotation (use_qk_norm: --qk-layernorm) and
rotary embeddings on the first partial_rotary_factor of each head's channels (--rotary-percent), rotated as
halves, as ours: transformers' Glm4Moe pairs channel i with i + r/2 of the rotated r, so q and k rows are copied
as they are (GLM-4's dense model, not imported here, rotates interleaved pairs). The first first_k_dense_replace
layers are dense, the others DeepSeek-V3's mixture of experts (``deepseek.deepseek_experts``): sigmoid scores
chosen with e_score_correction_bias, groups by their best two, the top-k renormalised, x routed_scaling_factor,
and n_shared_experts shared experts. transformers computes no load-balancing loss for it. Its multi-token
prediction layers (num_nextn_predict_layers) are DeepSeek-V3's (``multi_token_prediction``).

Its weights are named as Llama's, its experts as DeepSeek's (``weights``, naming ``glm4_moe``).
"""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.deepseek import DEEPSEEK_MOE_FIELDS, deepseek_experts, deepseek_experts_to_hf
from megatron_lite.interop.hf.experts import has_experts
from megatron_lite.interop.hf.family import Family, set_fields
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours
from megatron_lite.interop.hf.multi_token_prediction import MTP_FIELDS, mtp_fields_to_hf, mtp_fields_to_ours
from megatron_lite.interop.hf.rope import rope_to_ours

# transformers' Glm4MoeConfig defaults, for the fields a config.json leaves out (partial_rotary_factor: its
# __post_init__'s default when neither rope_parameters nor the top level names one).
GLM4_MOE_DEFAULTS = {"first_k_dense_replace": 1, "n_routed_experts": 128, "moe_intermediate_size": 1408,
                     "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                     "num_experts_per_tok": 8, "norm_topk_prob": True, "partial_rotary_factor": 0.5}


def _glm4_moe_to_ours(hf: dict) -> dict:
    hf = {**GLM4_MOE_DEFAULTS, **set_fields(hf)}
    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]
    # Llama's fields, but RoPE read again to take partial_rotary_factor, which Llama refuses.
    unrotated = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
    fields = dict(llama_to_ours(unrotated),
                  add_qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=bool(hf.get("use_qk_norm", False)),
                  **rope_to_ours(hf, partial_rotary=True))
    if dense < layers:
        fields.update(deepseek_experts({**hf, "topk_method": "noaux_tc"}, dense, 3))  # Glm4Moe's only router
    return dict(fields, **mtp_fields_to_ours(hf))


def _glm4_moe_to_hf(config: ModelConfig) -> dict:
    fields = dict(llama_to_hf(config), attention_bias=config.add_qkv_bias, use_qk_norm=config.qk_layernorm,
                  **deepseek_experts_to_hf(config, 3), **mtp_fields_to_hf(config))
    fields["rope_parameters"] = dict(fields["rope_parameters"], partial_rotary_factor=config.rotary_percent)
    return fields


GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe",
                  LLAMA_FIELDS | (DEEPSEEK_MOE_FIELDS - {"topk_method"}) | {
                      "first_k_dense_replace", "attention_bias", "use_qk_norm", "partial_rotary_factor"} | MTP_FIELDS,
                  _glm4_moe_to_ours, _glm4_moe_to_hf,
                  features={"num_experts": has_experts, "add_qkv_bias": True},
                  also=frozenset({"qk_layernorm", "mtp_num_layers"}))
