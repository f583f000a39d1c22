"""Mixtral (``MixtralForCausalLM``): Mistral with a mixture of experts in every layer."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.experts import ROUTER_FIELDS, has_experts, router_to_hf, router_to_ours
from megatron_lite.interop.hf.family import Family, refuse
from megatron_lite.interop.hf.llama import LLAMA_FIELDS
from megatron_lite.interop.hf.mistral import mistral_to_hf, mistral_to_ours


def _mixtral_to_ours(hf: dict) -> dict:
    refuse(hf.get("router_jitter_noise", 0.0) != 0.0, "router_jitter_noise (multiplicative noise on the router input)")
    layers = hf["num_hidden_layers"]
    return dict(mistral_to_ours(hf), moe_ffn_hidden_size=hf["intermediate_size"], **router_to_ours(
        hf, num_experts=hf.get("num_local_experts", 8), topk=hf.get("num_experts_per_tok", 2),
        coef=hf.get("router_aux_loss_coef", 0.001), moe_layers=[True] * layers))


def _mixtral_to_hf(config: ModelConfig) -> dict:
    return dict(mistral_to_hf(config), **router_to_hf(config), intermediate_size=config.moe_ffn_hidden_size,
                num_local_experts=config.num_experts, router_jitter_noise=0.0)


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "mixtral",
                 LLAMA_FIELDS | ROUTER_FIELDS | {"sliding_window", "num_local_experts", "router_jitter_noise"},
                 _mixtral_to_ours, _mixtral_to_hf, features={"num_experts": has_experts},
                 also=frozenset({"window_size"}))
