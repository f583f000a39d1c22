"""Which positions of a sequence each context-parallel rank holds, and a batch cut down to them.

Causal attention does more work for late queries than for early ones (query i sees i + 1 keys), so
cutting the sequence into cp contiguous pieces would leave the last rank with most of the work. The
sequence is cut into 2 x cp equal chunks instead and rank i holds chunks i and 2 cp - 1 - i, one early
and one late, so every rank attends over the same number of (query, key) pairs (docs/reference.md
section 15). A rank's activations are its two chunks one after the other, [chunk i; chunk 2cp-1-i].

Every rank of a context-parallel group reads the same micro-batch (they share a data-parallel rank) and
keeps its chunks of every per-position field: tokens, labels and loss mask (the labels are already the
next tokens, so a chunk's last label is the first token of the next chunk, as in the whole sequence),
and position ids (so rotary and learned position embeddings see the true positions). A packed batch's
documents (``document_ids`` [b, s]) become this rank's query rows of their block-diagonal causal mask, every key
column in sequence order ([b, 1, s/cp, s]); a given attention mask [b, 1, s, s] (generation's padding) keeps its
rows the same way.
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
    sequence, the attention mask [b, 1, s, s] along its query rows; packed documents become the rows of their
    mask."""
    if cp_size == 1:
        return batch
    positions = local_positions(batch["tokens"].shape[1], cp_rank, cp_size)
    cut = {key: value.index_select(2 if key == "attention_mask" else 1, positions) for key, value in batch.items()
           if key != "document_ids"}
    if "document_ids" in batch:
        document_ids = batch["document_ids"]
        cut["attention_mask"] = packed_attention_mask(document_ids, positions.to(document_ids.device))
    return cut


def packed_attention_mask(document_ids: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, q, s], True where the query at each of ``query_positions`` [q] may not attend: a later key, or
    one of another document (``document_ids`` [b, s])."""
    keys = torch.arange(document_ids.shape[1], device=document_ids.device)
    later = keys > query_positions[:, None]
    other = document_ids[:, query_positions, None] != document_ids[:, None, :]
    return (later | other)[:, None]


def slice_batches(iterator, cp_rank: int, cp_size: int):
    """The micro-batches of ``iterator``, each cut to this rank's positions (``iterator`` itself at cp 1)."""
    if cp_size == 1:
        return iterator
    return (get_batch_on_this_cp_rank(batch, cp_rank, cp_size) for batch in iterator)
