"""gpt-oss (``GptOssForCausalLM``): Llama's norms and grouped-query attention with biases on q/k/v/o and a
learned sink per head (--softmax-type learnable), sliding-window layers alternating with global ones
(``layer_types``: --window-size, --window-attn-skip-freq), YaRN, and experts in every layer: router and experts
with biases (--add-bias-linear), top-k of the router's logits then a softmax over them, and the experts' gated
unit (up + 1) * gate * sigmoid(1.702 gate) with the gate clamped to at most swiglu_limit and up to
[-limit, limit] (--quick-geglu, --glu-linear-offset 1, --activation-func-clamp-value limit).

transformers reads no ``hidden_act`` here (the experts' unit is fixed), and a ``swiglu_alpha`` other than
quick GELU's 1.702 is refused, as is ``attention_bias`` false (the router and experts keep theirs). The released
checkpoints are MXFP4-quantised (``quantization_config``, refused by name as an unread field): import a
dequantised bf16 or fp32 copy. The weights: ``gpt_oss_weights``.
"""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.experts import ROUTER_FIELDS, has_experts, router_to_hf, router_to_ours
from megatron_lite.interop.hf.family import Family, refuse
from megatron_lite.interop.hf.gemma import layer_pattern
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours

QUICK_GELU_ALPHA = 1.702  # quick GELU's sigmoid gain, fixed in Megatron-Core's quick_gelu


def _window(hf: dict) -> dict:
    """--window-size and --window-attn-skip-freq of ``sliding_window`` and ``layer_types`` (by default layer i
    slides when i is even), as Gemma's; none where no layer slides."""
    if set(hf.get("layer_types") or ["sliding_attention"]) == {"full_attention"} or hf.get("sliding_window") is None:
        return {}
    window, skip_freq = layer_pattern(hf, every=2)
    # Key j is seen by query i when i - j < sliding_window: Megatron's window (sliding_window - 1, 0).
    return dict(window_size=[window - 1, 0], window_attn_skip_freq=skip_freq)


def _gpt_oss_to_ours(hf: dict) -> dict:
    refuse(not hf.get("attention_bias", True), "attention_bias false (attention without biases, experts with)")
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    refuse(alpha != QUICK_GELU_ALPHA, f"swiglu_alpha {alpha} (quick GELU's sigmoid gain is {QUICK_GELU_ALPHA})")
    layers = hf["num_hidden_layers"]
    fields = llama_to_ours({**hf, "hidden_act": "silu"})  # GptOss's experts read no hidden_act
    return dict(fields, add_bias_linear=True, softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
                activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
                moe_ffn_hidden_size=hf["intermediate_size"], **_window(hf), **router_to_ours(
                    hf, num_experts=hf.get("num_local_experts", 128), topk=hf.get("num_experts_per_tok", 4),
                    coef=hf.get("router_aux_loss_coef", 0.001), moe_layers=[True] * layers))


def _gpt_oss_to_hf(config: ModelConfig) -> dict:
    freq = config.window_attn_skip_freq
    local = [config.window_size is not None and not (freq and (i + 1) % freq == 0) for i in range(config.num_layers)]
    return dict(llama_to_hf(config), **router_to_hf(config), attention_bias=True,
                intermediate_size=config.moe_ffn_hidden_size, num_local_experts=config.num_experts,
                swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=config.activation_func_clamp_value,
                sliding_window=config.window_size[0] + 1 if config.window_size else None,
                layer_types=["sliding_attention" if slides else "full_attention" for slides in local])


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", "gpt_oss",
                 LLAMA_FIELDS | ROUTER_FIELDS | {"attention_bias", "sliding_window", "layer_types", "num_local_experts",
                                                 "swiglu_alpha", "swiglu_limit"},
                 _gpt_oss_to_ours, _gpt_oss_to_hf,
                 features={"num_experts": has_experts, "softmax_type": "learnable", "quick_geglu": True,
                           "glu_linear_offset": 1.0, "activation_func_clamp_value": lambda clamp: clamp is not None},
                 also=frozenset({"window_size"}))
