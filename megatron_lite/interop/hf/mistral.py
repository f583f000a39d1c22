"""Mistral (``MistralForCausalLM``): Llama with a sliding window."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family
from megatron_lite.interop.hf.llama import LLAMA_FIELDS, llama_to_hf, llama_to_ours


def mistral_to_ours(hf: dict) -> dict:
    window = hf.get("sliding_window")
    # Mistral's key j is seen by query i when i - j < sliding_window: Megatron's window (sliding_window - 1, 0).
    return dict(llama_to_ours(hf), window_size=None if window is None else [window - 1, 0])


def mistral_to_hf(config: ModelConfig) -> dict:
    return dict(llama_to_hf(config), sliding_window=config.window_size[0] + 1 if config.window_size else None)


MISTRAL = Family("mistral", "MistralForCausalLM", "llama", LLAMA_FIELDS | {"sliding_window"}, mistral_to_ours,
                 mistral_to_hf, features={"window_size": lambda window: window is not None})
