"""The routing fields the Llama-like mixture-of-experts families share (Mixtral, Qwen3-MoE, OLMoE)."""
from __future__ import annotations

from megatron_lite.config import ModelConfig


ROUTER_FIELDS = frozenset({"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"})


def router_to_ours(hf: dict, *, num_experts: int, topk: int, coef: float, moe_layers: list[bool],
                   norm_topk_prob: bool = True) -> dict:
    """The routing fields every MoE family shares: E experts, top-k of a softmax (renormalised over the k,
    ``norm_topk_prob``, or kept as they are: --moe-router-pre-softmax), which layers have experts, and
    transformers' load-balancing loss (pooled over the layers, the module docstring says how)."""
    pattern = "1" if all(moe_layers) else str([int(moe) for moe in moe_layers])  # ModelConfig's spelling
    return dict(num_experts=num_experts, moe_router_topk=topk, moe_router_pre_softmax=not norm_topk_prob,
                moe_layer_freq=pattern, moe_router_load_balancing_type="pooled_aux_loss",
                moe_aux_loss_coeff=coef if hf.get("output_router_logits") else 0.0)


def router_to_hf(config: ModelConfig) -> dict:
    """A model trained here with Megatron-LM's per-layer loss gets the coefficient whose pooled loss weighs
    the layers alike (x L / k: exact for one layer, and where the layers route alike)."""
    coeff, balancing = config.moe_aux_loss_coeff, config.moe_router_load_balancing_type
    if balancing == "aux_loss":
        coeff *= sum(config.is_moe_layer(i) for i in range(config.num_layers)) / config.moe_router_topk
    return {"num_experts_per_tok": config.moe_router_topk, "router_aux_loss_coef": coeff,
            "output_router_logits": coeff > 0 and balancing != "none"}


def has_experts(num_experts) -> bool:
    return num_experts is not None
