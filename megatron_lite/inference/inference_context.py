"""The key/value cache of one batch being generated (Megatron-Core's static inference context).

Generation runs the prompt through the model once, then one new token per step. Each
step's queries need the keys and values of every earlier token, which do not change:
each attention layer stores them here instead of recomputing them, so a step costs one
token's work. The cache is allocated once per layer, at its first use, for the longest
sequence the batch will reach, and filled in place.

What a layer caches is its own affair: standard attention its keys and values,
multi-latent attention the compressed latent they are expanded from and the rotary key
its heads share (kv_lora_rank + qk_pos_emb_head_dim numbers per token instead of
heads x (key + value width)).

Each rank holds only what its layers compute: a tensor-parallel rank its own query
groups' keys and values (multi-latent attention's latent is every head's, so each rank
holds it whole), a pipeline stage its own layers. ``sequence_len_offset`` is
how many positions are already cached; the new tokens of a forward pass take the
positions after it (the model numbers them from it when given no position ids).

Under context parallelism (``context_parallel``) the first forward pass, the prompts' prefill, runs split:
each context-parallel rank holds its chunks of the prompts (``context_parallel/sharding.py``), and every
layer all-gathers the new keys and values into the cache in sequence order (``splits_sequence``), so each
rank ends the prefill with the whole prompts' cache, and its queries attend chunk by chunk
(``context_parallel.attend_own_chunks``). Every later pass (one new token per sequence) runs whole on every
rank, on its own full cache: the ranks compute the same tokens, without a sequence to split.

A gated DeltaNet layer (linear attention) keeps no positions at all: its state is the last few inputs of its
convolution and its scan's state, of a fixed size, replaced at every step (``recurrent_state``).

A sliding-window layer (Mistral, Gemma's local layers) never looks further back than its
window, so it keeps only that many positions: its memory stays the window's however long
the sequence grows. Its keys then start later than the other layers', and the attention
takes the last columns of the mask to match.
"""
from __future__ import annotations

import torch

from megatron_lite.context_parallel import ContextParallelConfig, gather_sequence


class StaticInferenceContext:
    def __init__(self, max_sequence_length: int, context_parallel: ContextParallelConfig | None = None):
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, ...]] = {}
        self.context_parallel = context_parallel
        self.recurrent_states: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def splits_sequence(self) -> bool:
        """Whether this forward pass holds only this rank's chunks of the sequence: the prefill (nothing cached
        yet) under context parallelism."""
        return self.context_parallel is not None and self.sequence_len_offset == 0

    def recurrent_state(self, layer_number: int) -> tuple[torch.Tensor, ...] | None:
        """Layer ``layer_number``'s state after the tokens so far (each tensor [b, ...]), None before the first."""
        return self.recurrent_states.get(layer_number)

    def set_recurrent_state(self, layer_number: int, state: tuple[torch.Tensor, ...]) -> None:
        self.recurrent_states[layer_number] = state

    def append_key_value(self, layer_number: int, *tensors: torch.Tensor,
                         window: int | None = None) -> tuple[torch.Tensor, ...]:
        """Store layer ``layer_number``'s tensors of the new tokens (each [s, b, ...]: keys and values, or a
        latent and a rotary key) after the cached ones; returns each over every position so far ([offset + s,
        b, ...]).

        The cache holds each tensor with its positions second to last ([b, groups, positions, d] for keys),
        the layout attention reads them in: what it hands back is a permuted view whose every head's positions
        are contiguous rows, so each decoding step reads the cache in place instead of gathering rows b x groups
        apart.

        ``window``: the layer's queries see only the ``window`` positions before their own (a sliding
        window), so only the last ``window`` are kept, and returned before the new ones.

        Under ``splits_sequence`` the tensors are this rank's positions, and the whole sequence's are cached
        and returned."""
        if self.splits_sequence:
            tensors = tuple(gather_sequence(t, self.context_parallel) for t in tensors)
        end = self.sequence_len_offset + tensors[0].shape[0]
        if end > self.max_sequence_length:
            raise ValueError(f"the key/value cache holds {self.max_sequence_length} positions; "
                             f"this step needs {end}.")
        if window is not None:
            return self._append_in_window(layer_number, tensors, window)
        if layer_number not in self.key_value_memory_dict:
            self.key_value_memory_dict[layer_number] = tuple(
                t.new_empty((*t.shape[1:-1], self.max_sequence_length, t.shape[-1])) for t in tensors)
        cached = self.key_value_memory_dict[layer_number]
        for store, new in zip(cached, tensors):
            store[..., self.sequence_len_offset:end, :] = new.movedim(0, -2)
        return tuple(store[..., :end, :].movedim(-2, 0) for store in cached)

    def _append_in_window(self, layer_number: int, tensors: tuple[torch.Tensor, ...], window: int):
        stores = tuple(t.movedim(0, -2) for t in tensors)
        cached = self.key_value_memory_dict.get(layer_number)
        if cached is not None:
            stores = tuple(torch.cat([store, new], dim=-2) for store, new in zip(cached, stores))
        first_kept = max(0, stores[0].shape[-2] - window)
        # Copies, so the whole step's keys (a long prompt's) are not kept alive through a view.
        self.key_value_memory_dict[layer_number] = tuple(t[..., first_kept:, :].clone() for t in stores)
        return tuple(t.movedim(-2, 0) for t in stores)

    def increment_sequence_len_offset(self, num_tokens: int) -> None:
        """Called once a forward pass has gone through every layer of this rank."""
        self.sequence_len_offset += num_tokens
