"""Chunked local attention (Llama 4; ``--attention-chunk-size C``): the positions of a sequence are cut into
chunks of C, and a query sees the earlier keys of its own chunk only. It acts on the layers with rotary
embeddings; the NoPE layers (--no-rope-freq) attend to the whole sequence (Llama 4's "interleaved RoPE").

Positions are the model's ``position_ids``, 0 at each sequence's first token: each packed example's, each
left-padded prompt's first real token. A query at position p is the (p mod C)-th of its chunk, so it sees back
p mod C keys: one more mask, OR-ed with whatever attention already masks (causal, packed examples, a
generation's padding), and counted in distances along the key sequence, as the generation cache stores the
keys (the chunked layers cache them all). transformers' Llama 4 counts its chunks the same way.

A position is never past its key column (positions restart at packed examples and after left padding, never
skip ahead), so keys no longer than a chunk are all in their sequence's first: the mask would add nothing to
what attention already masks, and is left out, which keeps a sequence of at most one chunk (a fine-tune of the
released models, chunks of 8192) on the causal fast path.
"""
import torch

from megatron_lite.config import ModelConfig


class ChunkedAttention:
    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def mask(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, key_length: int) -> torch.Tensor:
        """``attention_mask`` (bool [b or 1, 1, s, key_length], True = may not attend; None = causal) with the keys
        outside each query's chunk added. ``position_ids`` [b, s]: the queries', the last s of the keys."""
        if key_length <= self.chunk_size:
            return attention_mask
        query_length = position_ids.shape[1]
        columns = torch.arange(key_length, device=position_ids.device)
        rows = torch.arange(key_length - query_length, key_length, device=position_ids.device)
        distance = rows[:, None] - columns  # [s, key_length]: how far back each key is from each query
        seen = (position_ids % self.chunk_size)[:, None, :, None]  # [b, 1, s, 1]: back to its chunk's first key
        outside = (distance < 0) | (distance > seen)
        return outside if attention_mask is None else attention_mask | outside


def layer_chunks(config: ModelConfig, layer_number: int) -> ChunkedAttention | None:
    """The chunking of layer ``layer_number`` (global, 0-based), or None where it attends to the whole sequence."""
    if config.attention_chunk_size is None or config.is_nope_layer(layer_number):
        return None
    return ChunkedAttention(config.attention_chunk_size)
