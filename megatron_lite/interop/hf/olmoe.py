"""OLMoE (``OlmoeForCausalLM``): Llama with q/k RMSNorm over the whole projections and experts in every layer."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.experts import ROUTER_FIELDS, has_experts, router_to_hf, router_to_ours
from megatron_lite.interop.hf.family import Family, refuse, without_biases
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours


def _olmoe_to_ours(hf: dict) -> dict:
    """Llama with q/k RMSNorms over the whole projections and experts (intermediate_size wide) in every layer."""
    refuse(hf.get("clip_qkv") is not None, "clip_qkv (queries, keys and values clamped)")
    heads = hf["num_attention_heads"]
    refuse(hf.get("head_dim", hf["hidden_size"] // heads) * heads != hf["hidden_size"],
           "head_dim x num_attention_heads other than hidden_size (OLMoE's q_norm is hidden_size wide)")
    return dict(llama_to_ours({"rms_norm_eps": 1e-5, **hf}), qk_layernorm=True, qk_layernorm_whole_projection=True,
                moe_ffn_hidden_size=hf["intermediate_size"], **router_to_ours(
                    hf, num_experts=hf.get("num_experts", 64), topk=hf.get("num_experts_per_tok", 8),
                    coef=hf.get("router_aux_loss_coef", 0.01), moe_layers=[True] * hf["num_hidden_layers"],
                    norm_topk_prob=hf.get("norm_topk_prob", False)))


def _olmoe_to_hf(config: ModelConfig) -> dict:
    return dict(llama_to_hf(config), **router_to_hf(config), attention_bias=False, clip_qkv=None,
                intermediate_size=config.moe_ffn_hidden_size, num_experts=config.num_experts,
                norm_topk_prob=not config.moe_router_pre_softmax)


OLMOE = Family("olmoe", "OlmoeForCausalLM", "qwen_moe",
               LLAMA_FIELDS | ROUTER_FIELDS | {"attention_bias", "clip_qkv", "num_experts", "norm_topk_prob"},
               without_biases(_olmoe_to_ours), _olmoe_to_hf,
               features={"num_experts": has_experts, "qk_layernorm": True, "qk_layernorm_whole_projection": True})
