"""SmolLM3 (``SmolLM3ForCausalLM``): Llama with NoPE layers (--no-rope-freq)."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse, set_fields, without_biases
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours


SMOLLM3_THETA = 2_000_000.0  # SmolLM3Config's rope_theta where config.json leaves it out


def _smollm3_to_ours(hf: dict) -> dict:
    """Llama with NoPE layers: no_rope_layers (1: the layer rotates), by default every no_rope_layer_interval-th
    layer without rotary embeddings; our --no-rope-freq marks the other way round. SmolLM3's defaults differ from
    Llama's: tied embeddings, rope_theta 2e6."""
    refuse(hf.get("use_sliding_window", False), "use_sliding_window (sliding attention on the NoPE layers)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    refuse(layer_types != {"full_attention"}, f"layer_types {sorted(layer_types)} (only full_attention)")
    layers, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    rotates = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    refuse(len(rotates) < layers, f"no_rope_layers of {len(rotates)} entries for {layers} layers")
    nope = [int(not rotate) for rotate in rotates[:layers]]
    fields = llama_to_ours({"rope_theta": SMOLLM3_THETA, **set_fields(hf)})
    return dict(fields, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                no_rope_freq=str(nope) if any(nope) else None)  # ModelConfig's spelling


def _smollm3_to_hf(config: ModelConfig) -> dict:
    return dict(llama_to_hf(config), attention_bias=False, mlp_bias=False, use_sliding_window=False,
                no_rope_layers=[int(not config.is_nope_layer(i)) for i in range(config.num_layers)],
                layer_types=["full_attention"] * config.num_layers)


SMOLLM3 = Family("smollm3", "SmolLM3ForCausalLM", "llama",
                 LLAMA_FIELDS | {"attention_bias", "mlp_bias", "pretraining_tp", "use_sliding_window", "sliding_window",
                                 "max_window_layers", "no_rope_layers", "no_rope_layer_interval", "layer_types"},
                 without_biases(_smollm3_to_ours), _smollm3_to_hf,
                 features={"no_rope_freq": lambda freq: freq is not None})
