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
"""
from __future__ import annotations

import torch


class StaticInferenceContext:
    def __init__(self, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append_key_value(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Store layer ``layer_number``'s keys and values of the new tokens ([s, b, groups, d]) after the
        cached ones; returns the keys and values of every position so far ([offset + s, b, groups, d]).

        The cache is laid out [b, groups, positions, d], the layout attention reads them in: what it is
        handed back is a permuted view whose every head's positions are contiguous rows, so each step's
        attention reads the cache in place instead of gathering it from rows b x groups apart."""
        end = self.sequence_len_offset + key.shape[0]
        if end > self.max_sequence_length:
            raise ValueError(f"the key/value cache holds {self.max_sequence_length} positions; "
                             f"this step needs {end}.")
        if layer_number not in self.key_value_memory_dict:
            batch, groups, head_dim = key.shape[1:]
            shape = (batch, groups, self.max_sequence_length, head_dim)
            self.key_value_memory_dict[layer_number] = (key.new_empty(shape), value.new_empty(shape))
        keys, values = self.key_value_memory_dict[layer_number]
        keys[:, :, self.sequence_len_offset:end] = key.permute(1, 2, 0, 3)
        values[:, :, self.sequence_len_offset:end] = value.permute(1, 2, 0, 3)
        return keys[:, :, :end].permute(2, 0, 1, 3), values[:, :, :end].permute(2, 0, 1, 3)

    def increment_sequence_len_offset(self, num_tokens: int) -> None:
        """Called once a forward pass has gone through every layer of this rank."""
        self.sequence_len_offset += num_tokens
