"""Qwen2/2.5 (``Qwen2ForCausalLM``: q/k/v biases), Qwen3 (``Qwen3ForCausalLM``: q/k RMSNorm, head_dim) and
Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3 with experts where decoder_sparse_step and mlp_only_layers put them)."""
from __future__ import annotations

from typing import Callable

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.experts import ROUTER_FIELDS, has_experts, router_to_hf, router_to_ours
from megatron_lite.interop.hf.family import Family, refuse, without_biases
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours


QWEN_WINDOW_FIELDS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})


def _qwen_attention(to_ours: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """Qwen2/Qwen3 name a per-layer sliding window that their released dense models leave off."""
    def read(hf: dict) -> dict:
        refuse(hf.get("use_sliding_window", False), "use_sliding_window (sliding attention in some layers)")
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        refuse(layer_types != {"full_attention"}, f"layer_types {sorted(layer_types)} (only full_attention)")
        return to_ours(hf)
    return read


def _qwen3_moe_to_ours(hf: dict) -> dict:
    """Qwen3 with experts in layer i when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers,
    dense MLPs (intermediate_size wide) elsewhere; transformers 5 writes num_experts as num_local_experts."""
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    refuse(not any(moe_layers), "no mixture-of-experts layer (decoder_sparse_step, mlp_only_layers): import it as "
           "qwen3")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    return dict(llama_to_ours(hf), qk_layernorm=True, moe_ffn_hidden_size=hf.get("moe_intermediate_size", 768),
                **router_to_ours(hf, num_experts=experts, topk=hf.get("num_experts_per_tok", 8),
                                 coef=hf.get("router_aux_loss_coef", 0.001), moe_layers=moe_layers,
                                 norm_topk_prob=hf.get("norm_topk_prob", False)))


def _qwen3_moe_to_hf(config: ModelConfig) -> dict:
    return dict(llama_to_hf(config), **router_to_hf(config), attention_bias=False, use_sliding_window=False,
                num_experts=config.num_experts, moe_intermediate_size=config.moe_ffn_hidden_size,
                norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe_layer(i)])


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "llama", LLAMA_FIELDS | QWEN_WINDOW_FIELDS,
               _qwen_attention(lambda hf: dict(llama_to_ours(hf), add_qkv_bias=True)),
               lambda config: dict(llama_to_hf(config), use_sliding_window=False),
               features={"add_qkv_bias": True})

QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "llama", LLAMA_FIELDS | QWEN_WINDOW_FIELDS | {"attention_bias"},
               _qwen_attention(without_biases(lambda hf: dict(llama_to_ours(hf), qk_layernorm=True))),
               lambda config: dict(llama_to_hf(config), attention_bias=False, use_sliding_window=False),
               features={"qk_layernorm": True})

QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen_moe",
                   LLAMA_FIELDS | QWEN_WINDOW_FIELDS | ROUTER_FIELDS | {
                       "attention_bias", "num_experts", "num_local_experts", "moe_intermediate_size", "norm_topk_prob",
                       "decoder_sparse_step", "mlp_only_layers"},
                   _qwen_attention(without_biases(_qwen3_moe_to_ours)), _qwen3_moe_to_hf,
                   features={"num_experts": has_experts, "qk_layernorm": True})
