"""The key/value cache of one batch being generated (Megatron-Core's static inference context).

Generation runs the prompt through the model once, then one new token per step. Each
step's queries need the keys and values of every earlier token, which do not change:
each attention layer stores them here instead of recomputing them, so a step costs one
token's work. The cache is allocated once per layer, at its first use, for the longest
sequence the batch will reach, and filled in place.

Each rank holds only what its layers compute: a tensor-parallel rank its own query
groups' keys and values, a pipeline stage its own layers. ``sequence_len_offset`` is
how many positions are already cached; the new tokens of a forward pass take the
positions after it (the model numbers them from it when given no position ids).

A sliding-window layer (Mistral, Gemma's local layers) never looks further back than its
window, so it keeps only that many positions: its memory stays the window's however long
the sequence grows. Its keys then start later than the other layers', and the attention
takes the last columns of the mask to match.
"""
from __future__ import annotations

import torch


class StaticInferenceContext:
    def __init__(self, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append_key_value(self, layer_number: int, key: torch.Tensor, value: torch.Tensor, *,
                         window: int | None = None):
        """Store layer ``layer_number``'s keys and values of the new tokens ([s, b, groups, d]) after the
        cached ones; returns the keys and values of every position so far ([offset + s, b, groups, d]).

        ``window``: the layer's queries see only the ``window`` positions before their own (a sliding
        window), so only the last ``window`` are kept, and returned before the new ones."""
        end = self.sequence_len_offset + key.shape[0]
        if end > self.max_sequence_length:
            raise ValueError(f"the key/value cache holds {self.max_sequence_length} positions; "
                             f"this step needs {end}.")
        if window is not None:
            return self._append_in_window(layer_number, key, value, window)
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_sequence_length, *key.shape[1:])
            self.key_value_memory_dict[layer_number] = (key.new_empty(shape), value.new_empty(shape))
        keys, values = self.key_value_memory_dict[layer_number]
        keys[self.sequence_len_offset:end] = key
        values[self.sequence_len_offset:end] = value
        return keys[:end], values[:end]

    def _append_in_window(self, layer_number: int, key: torch.Tensor, value: torch.Tensor, window: int):
        cached = self.key_value_memory_dict.get(layer_number)
        keys, values = (key, value) if cached is None else (torch.cat([cached[0], key]), torch.cat([cached[1], value]))
        first_kept = max(0, keys.shape[0] - window)
        # Copies, so the whole step's keys (a long prompt's) are not kept alive through a view.
        self.key_value_memory_dict[layer_number] = (keys[first_kept:].clone(), values[first_kept:].clone())
        return keys, values

    def increment_sequence_len_offset(self, num_tokens: int) -> None:
        """Called once a forward pass has gone through every layer of this rank."""
        self.sequence_len_offset += num_tokens
