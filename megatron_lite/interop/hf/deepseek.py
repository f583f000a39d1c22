"""DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-latent attention, the first
layers dense, then mixtures of experts with shared experts."""
from __future__ import annotations

from typing import Callable

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse, set_fields
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours
from megatron_lite.interop.hf.multi_token_prediction import MTP_FIELDS, mtp_fields_to_hf, mtp_fields_to_ours
from megatron_lite.interop.hf.rope import YARN_FIELDS, rope_to_ours


def _deepseek_reader(version: int) -> Callable[[dict], dict]:
    """DeepSeek-V2 or V3's config.json: multi-latent attention, the first first_k_dense_replace layers dense (their
    defaults differ: 0 and 3), then mixtures of experts (``deepseek_experts``)."""
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
        fields = dict(llama_to_ours({**hf, "rope_parameters": None, "rope_scaling": None, "head_dim": None}),
                      **latent)
        rope = rope_to_ours(hf, latent=True)
        refuse(set(rope) - {"rotary_base", "rope_type"} - set(YARN_FIELDS) != set(),
               "rope scaling other than yarn (rope_parameters.rope_type; DeepSeek's attention scales with yarn)")
        if dense < layers:
            fields.update(deepseek_experts({**DEEPSEEK_DEFAULTS[version], **set_fields(hf)}, dense, version))
        if version == 3:
            fields.update(mtp_fields_to_ours(hf))
        return dict(fields, **rope)
    return read


# transformers' DeepseekV2Config / DeepseekV3Config defaults, for the fields a config.json leaves out.
DEEPSEEK_DEFAULTS = {
    2: {"first_k_dense_replace": 0, "n_routed_experts": 64, "moe_intermediate_size": 1407, "n_shared_experts": 2,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False},
    3: {"first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "topk_method": "noaux_tc", "norm_topk_prob": True}}


def deepseek_experts(hf: dict, dense: int, version: int) -> dict:
    """DeepSeek's mixture-of-experts layers (after the first ``dense``), as transformers computes them: V2 the top-k
    of a softmax over all experts as they are (within the groups of highest best score with topk_method
    group_limited_greedy), V3 the top-k of sigmoid scores chosen with e_score_correction_bias (our expert bias)
    within the groups whose best two sum highest, renormalised; both times routed_scaling_factor, plus
    n_shared_experts shared experts as one MLP. transformers computes no load-balancing loss for either."""
    layers, experts, topk = hf["num_hidden_layers"], hf["n_routed_experts"], hf["num_experts_per_tok"]
    width, shared, scale = hf["moe_intermediate_size"], hf.get("n_shared_experts", 0), hf["routed_scaling_factor"]
    groups, group_topk, method = hf.get("n_group"), hf.get("topk_group"), hf["topk_method"]
    fields = dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
                  moe_layer_freq=str([0] * dense + [1] * (layers - dense)),
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


def deepseek_experts_to_hf(config: ModelConfig, version: int) -> dict:
    """Inverse of ``deepseek_experts`` (a dense model: every layer before first_k_dense_replace)."""
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
    fields = {k: v for k, v in llama_to_hf(config).items() if k != "head_dim"}
    return dict(fields, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_head_dim, qk_rope_head_dim=config.qk_pos_emb_head_dim,
                v_head_dim=config.v_head_dim, num_key_value_heads=config.num_attention_heads, attention_bias=False,
                **deepseek_experts_to_hf(config, version))


# What a DeepSeek config.json sets for its mixture-of-experts layers (``deepseek_experts``; nothing in a model
# whose layers are all dense; output_router_logits: transformers computes no router loss from them).
DEEPSEEK_MOE_FIELDS = frozenset({
    "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group",
    "topk_group", "num_experts_per_tok", "norm_topk_prob", "output_router_logits", "topk_method"})


DEEPSEEK_FIELDS = LLAMA_FIELDS | DEEPSEEK_MOE_FIELDS | {
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
    "attention_bias", "pretraining_tp",
    "qk_head_dim"}  # qk_nope_head_dim + qk_rope_head_dim, which transformers recomputes (as head_dim)


# Multi-token prediction layers (num_nextn_predict_layers: interop/hf/multi_token_prediction.py) are not part of
# transformers' forward.
DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek",
                     DEEPSEEK_FIELDS | MTP_FIELDS | {"rope_interleave"}, _deepseek_reader(3),
                     lambda config: dict(_deepseek_to_hf(config, 3), rope_interleave=True, **mtp_fields_to_hf(config)),
                     features={"multi_latent_attention": True, "qk_layernorm": True},
                     also=frozenset({"num_experts", "mtp_num_layers"}))

# Exported when asked for (--hf-model-type deepseek_v2): V3 computes its dense models, not its experts.
DEEPSEEK_V2 = Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek", DEEPSEEK_FIELDS | {"mlp_bias"},
                     _deepseek_reader(2),
                     lambda config: dict(_deepseek_to_hf(config, 2), mlp_bias=False))
