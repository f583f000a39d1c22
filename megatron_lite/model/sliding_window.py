"""Sliding-window attention (Mistral; ``--window-size LEFT 0``): a query sees itself and the ``LEFT``
keys before it, never further back. With ``--window-attn-skip-freq N`` (Gemma 2: 2, Gemma 3: 6) every
Nth layer, counting from 1, attends globally instead, as Megatron-Core's ``window_attn_skip_freq``; the
others are the local layers (which Gemma 3 also rotates with their own RoPE base, ``embedding.py``).
The global layer number decides, so every pipeline split has the same local and global layers.

It is one more mask, OR-ed with whatever attention already masks (causal, packed examples, a
generation's padding), so training, packed SFT and the generation cache all take it. Queries are
the last ``query_length`` of ``key_length`` positions (earlier keys are cached or a prefix), and the
window counts positions in that key sequence, as the key/value cache stores them.
"""
import torch

from megatron_lite.config import ModelConfig


class SlidingWindow:
    def __init__(self, left: int):
        self.left = left

    def mask(self, attention_mask: torch.Tensor | None, query_length: int, key_length: int,
             device) -> torch.Tensor:
        """``attention_mask`` (True = may not attend; None = causal) with the keys outside the window added."""
        offset = key_length - query_length  # query i is key position i + offset
        outside = torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril(offset - self.left - 1)
        if attention_mask is None:
            future = torch.ones(query_length, key_length, dtype=torch.bool, device=device).triu(offset + 1)
            return future | outside
        return attention_mask | outside


def is_local_layer(config: ModelConfig, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (global, 0-based) attends through the sliding window."""
    if config.window_size is None:
        return False
    skip_freq = config.window_attn_skip_freq
    return skip_freq is None or (config.pattern_layer(layer_number) + 1) % skip_freq != 0


def layer_window(config: ModelConfig, layer_number: int) -> SlidingWindow | None:
    """The window of layer ``layer_number`` (global, 0-based), or None where it attends globally."""
    return SlidingWindow(config.window_size[0]) if is_local_layer(config, layer_number) else None
