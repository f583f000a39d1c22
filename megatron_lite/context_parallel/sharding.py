"""Which positions of a sequence each context-parallel rank holds, and a batch cut down to them.

Causal attention does more work for late queries than for early ones (query i sees i + 1 keys), so
cutting the sequence into cp contiguous pieces would leave the last rank with most of the work. The
sequence is cut into 2 x cp equal chunks instead and rank i holds chunks i and 2 cp - 1 - i, one early
and one late, so every rank attends over the same number of (query, key) pairs (docs/reference.md
section 15). A rank's activations are its two chunks one after the other, [chunk i; chunk 2cp-1-i].

Every rank of a context-parallel group reads the same micro-batch (they share a data-parallel rank) and
keeps its chunks of every per-position field: tokens, labels and loss mask (the labels are already the
next tokens, so a chunk's last label is the first token of the next chunk, as in the whole sequence),
and position ids (so rotary and learned position embeddings see the true positions). A given attention
mask [b, 1, s, s] keeps this rank's query rows and every key column, in sequence order. A packed batch's
documents (``document_ids`` [b, s]) stay whole: attention builds this rank's query rows of their mask from them.
"""
from __future__ import annotations

import torch


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp_size) rank ``cp_rank`` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Indices into the whole sequence of the positions rank ``cp_rank`` holds, in its order."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"a sequence of {seq_length} positions does not cut into 2 x {cp_size} equal chunks.")
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(cp_rank, cp_size)])


def global_order(cp_size: int, chunk: int) -> torch.Tensor:
    """The permutation that puts the ranks' positions, concatenated in rank order (an all-gather), into
    sequence order: ``gathered[global_order(...)]`` is the whole sequence."""
    held = torch.cat([local_positions(2 * cp_size * chunk, rank, cp_size) for rank in range(cp_size)])
    return torch.argsort(held)


def get_batch_on_this_cp_rank(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """``batch`` (Megatron's name) with every field cut to this rank's positions: [b, s] fields along the
    sequence, the attention mask [b, 1, s, s] along its query rows; the documents of a packed batch whole."""
    if cp_size == 1:
        return batch
    positions = local_positions(batch["tokens"].shape[1], cp_rank, cp_size)
    return {key: value if key == "document_ids" else value.index_select(2 if key == "attention_mask" else 1, positions)
            for key, value in batch.items()}


def slice_batches(iterator, cp_rank: int, cp_size: int):
    """The micro-batches of ``iterator``, each cut to this rank's positions (``iterator`` itself at cp 1)."""
    if cp_size == 1:
        return iterator
    return (get_batch_on_this_cp_rank(batch, cp_rank, cp_size) for batch in iterator)
