"""SmolLM3 (``SmolLM3ForCausalLM``): Llama with NoPE layers (--no-rope-freq), whose fields Llama 4 shares
(``nope_layers``)."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse, set_fields, without_biases
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours


SMOLLM3_THETA = 2_000_000.0  # SmolLM3Config's rope_theta where config.json leaves it out


def nope_layers(hf: dict) -> list[bool]:
    """Which layers are NoPE: no_rope_layers (1: the layer rotates), by default every no_rope_layer_interval-th
    layer (SmolLM3's and Llama 4's fields, read as their configs read them)."""
    layers, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    rotates = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    refuse(len(rotates) < layers, f"no_rope_layers of {len(rotates)} entries for {layers} layers")
    return [not rotate for rotate in rotates[:layers]]


def no_rope_freq(nope: list[bool]) -> str | None:
    """--no-rope-freq of the NoPE layers ``nope``: our flag marks the NoPE layers (1), theirs the others."""
    return str([int(n) for n in nope]) if any(nope) else None  # ModelConfig's spelling


def no_rope_layers(config: ModelConfig) -> list[int]:
    return [int(not config.is_nope_layer(i)) for i in range(config.num_layers)]


def _smollm3_to_ours(hf: dict) -> dict:
    """Llama with NoPE layers (``nope_layers``). SmolLM3's defaults differ from Llama's: tied embeddings,
    rope_theta 2e6."""
    refuse(hf.get("use_sliding_window", False), "use_sliding_window (sliding attention on the NoPE layers)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    refuse(layer_types != {"full_attention"}, f"layer_types {sorted(layer_types)} (only full_attention)")
    fields = llama_to_ours({"rope_theta": SMOLLM3_THETA, **set_fields(hf)})
    return dict(fields, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                no_rope_freq=no_rope_freq(nope_layers(hf)))


def _smollm3_to_hf(config: ModelConfig) -> dict:
    return dict(llama_to_hf(config), attention_bias=False, mlp_bias=False, use_sliding_window=False,
                no_rope_layers=no_rope_layers(config), layer_types=["full_attention"] * config.num_layers)


SMOLLM3 = Family("smollm3", "SmolLM3ForCausalLM", "llama",
                 LLAMA_FIELDS | {"attention_bias", "mlp_bias", "pretraining_tp", "use_sliding_window", "sliding_window",
                                 "max_window_layers", "no_rope_layers", "no_rope_layer_interval", "layer_types"},
                 without_biases(_smollm3_to_ours), _smollm3_to_hf,
                 features={"no_rope_freq": lambda freq: freq is not None})
