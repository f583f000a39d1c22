"""Chunked local attention (Llama 4; ``--attention-chunk-size C``): the positions of a sequence are cut into
chunks of C, and a query sees the earlier keys of its own chunk only. It acts on the layers with rotary
embeddings; the NoPE layers (--no-rope-freq) attend to the whole sequence (Llama 4's "interleaved RoPE").

Positions are the model's ``position_ids``, 0 at each sequence's first token: each packed example's, each
left-padded prompt's first real token. A query at position p is the (p mod C)-th of its chunk, so it sees back
p mod C keys: one more mask, OR-ed with whatever attention already masks (causal, packed examples, a
generation's padding), and counted in distances along the key sequence, as the generation cache stores the
keys (the chunked layers cache them all). transformers' Llama 4 counts its chunks the same way.

A position is never past its key column (positions restart at packed examples and after left padding, never
skip ahead), so keys no longer than a chunk are all in their sequence's first: the chunks would add nothing to
what attention already masks, and a sequence of at most one chunk (a fine-tune of the released models, chunks
of 8192) takes the core attention as it is, on the causal fast path.

Longer sequences never build a mask over the whole sequence ([b, 1, s, s]: O(s^2) memory, and no flash kernel
on CUDA). Attention runs chunk by chunk, one of two ways:

- folded: without a mask (no packing, no padding) and with every query's position its key column (0, 1, 2,
  ... from the row's first column), the chunks are the column blocks [0, C), [C, 2C), ...: the whole ones
  become a batch of their own, [C, n b, heads, d], attended causally in one call, and a shorter last one in
  another; queries that start inside a block (a context-parallel rank's second chunk of the sequence, a new
  token after cached keys) first finish that block against its earlier keys. Memory O(s C), and the core's
  causal (flash) kernel. The model decides it once per forward, on the host, from the positions it makes or
  is handed on the host (``GPTModel``'s ``positions_are_columns``): nothing is read back from the device.
- blocked: otherwise (packed examples, padding, positions that restart), C queries at a time against the
  keys their chunks can reach, C - 1 before the block's first query up to its last, under the given mask's
  rows and columns of them and the chunks' mask: [b, 1, C, 2C - 1] masks, O(s C) memory, exact for any mask
  and positions, on the core's masked kernel. One new token after a long cache attends to C keys at most.

Both compute the same softmax as the whole-sequence mask, over the same visible keys (within rounding: the
sums run over fewer keys).

Under context parallelism (``context_parallel/attention.py``) a rank holds two chunks of the sequence. The
all_gather core runs each of them as the queries after the earlier keys here, at its global columns; the ring
(p2p) skips the blocks of keys no query of a block reaches (``out_of_reach``, and ``reaches`` where positions are
the columns) and masks the others with ``mask``.
"""
import torch

from megatron_lite.config import ModelConfig


class ChunkedAttention:
    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def __call__(self, core_attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 positions_are_columns: bool = False) -> torch.Tensor:
        """``core_attention(query, key, value, attention_mask)`` (``DotProductAttention``'s interface: [s, b,
        heads, d] queries, [sk, b, groups, d] keys and values, the queries the last s of the keys; a bool mask
        [b or 1, 1, s, sk], True = may not attend, None = causal) with each query seeing the keys of its own
        chunk only. ``position_ids`` [b, s]: the queries'. The keys before the queries may be a generation's
        cache or, under context parallelism, the sequence's earlier positions: the queries are then a rank's
        chunk of the sequence at its global columns. ``positions_are_columns``: the caller knows, on the host,
        that every query's position is its key column (the model's own positions: no packed examples, no
        padding), which lets the chunks fold without a mask; False is exact whatever the positions."""
        key_length = key.shape[0]
        if key_length <= self.chunk_size:
            return core_attention(query, key, value, attention_mask)
        if attention_mask is None and positions_are_columns:
            return self._folded(core_attention, query, key, value)
        return self._blocked(core_attention, query, key, value, attention_mask, position_ids)

    def mask(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, key_length: int,
             first_row: int | None = None) -> torch.Tensor:
        """``attention_mask`` (bool [b or 1, 1, s, key_length], True = may not attend; None = causal) with the keys
        outside each query's chunk added. ``position_ids`` [b, s]: the queries'; query i sits at key column
        ``first_row`` + i (by default the queries are the last s of the keys; a context-parallel ring's block of
        queries may lie after its block of keys)."""
        query_length = position_ids.shape[1]
        first_row = key_length - query_length if first_row is None else first_row
        columns = torch.arange(key_length, device=position_ids.device)
        rows = torch.arange(first_row, first_row + query_length, device=position_ids.device)
        distance = rows[:, None] - columns  # [s, key_length]: how far back each key is from each query
        seen = (position_ids % self.chunk_size)[:, None, :, None]  # [b, 1, s, 1]: back to its chunk's first key
        outside = (distance < 0) | (distance > seen)
        return outside if attention_mask is None else attention_mask | outside

    def out_of_reach(self, first_query: int, last_key: int) -> bool:
        """Whether no query at or after key column ``first_query`` sees a key at or before ``last_key``: a query
        sees back at most C - 1 keys, whatever its position (the blocks a context-parallel ring skips)."""
        return first_query - last_key >= self.chunk_size

    def reaches(self, queries: range, keys: range) -> bool:
        """Whether any query at key columns ``queries`` sees any key at columns ``keys`` when positions are the
        columns: the first query at or after the first key sees back to its chunk's first column."""
        first = max(queries.start, keys.start)
        return first < queries.stop and first - first % self.chunk_size < keys.stop

    def folded_calls(self, query_length: int, key_length: int) -> list[tuple[slice, slice, int]]:
        """(queries, keys, blocks) of each core call the folded form makes for queries that are the last
        ``query_length`` of ``key_length`` keys at their columns: the queries before the first block boundary
        (if they start inside a block) against their block's earlier keys, the whole blocks (``blocks`` of
        them, folded into the batch when more than one), the shorter last block. The planner counts these."""
        chunk = self.chunk_size
        offset = key_length - query_length  # query i is key i + offset
        head = min(-offset % chunk, query_length)  # the queries before the first block boundary
        whole = head + (query_length - head) // chunk * chunk
        calls = []
        if head:
            calls.append((slice(0, head), slice(offset - offset % chunk, offset + head), 1))
        if whole > head:
            calls.append((slice(head, whole), slice(offset + head, offset + whole), (whole - head) // chunk))
        if whole < query_length:
            calls.append((slice(whole, query_length), slice(offset + whole, key_length), 1))
        return calls

    def _folded(self, core_attention, query, key, value) -> torch.Tensor:
        """Causal attention within each column block of C (``folded_calls``): whole blocks folded into the batch,
        [n C, b, ...] -> [C, n b, ...] and back."""
        chunk, batch = self.chunk_size, query.shape[1]

        def fold(tensor):
            return tensor.unflatten(0, (-1, chunk)).transpose(0, 1).flatten(1, 2)

        parts = []
        for queries, keys, blocks in self.folded_calls(query.shape[0], key.shape[0]):
            if blocks == 1:
                parts.append(core_attention(query[queries], key[keys], value[keys], None))
            else:
                context = core_attention(fold(query[queries]), fold(key[keys]), fold(value[keys]), None)
                parts.append(context.unflatten(1, (-1, batch)).transpose(0, 1).flatten(0, 1))
        return torch.cat(parts)

    def _blocked(self, core_attention, query, key, value, attention_mask, position_ids) -> torch.Tensor:
        """C queries at a time, each block against the keys from C - 1 before its first query to its last (a
        query sees back at most C - 1 keys), with the mask of those rows and columns."""
        chunk, seq = self.chunk_size, query.shape[0]
        offset = key.shape[0] - seq  # query i is key i + offset (after cached keys)
        blocks = []
        for start in range(0, seq, chunk):
            end = min(start + chunk, seq)
            first, last = max(start + offset - chunk + 1, 0), end + offset
            given = None if attention_mask is None else attention_mask[..., start:end, first:last]
            mask = self.mask(given, position_ids[:, start:end], last - first)
            blocks.append(core_attention(query[start:end], key[first:last], value[first:last], mask))
        return torch.cat(blocks)


def layer_chunks(config: ModelConfig, layer_number: int) -> ChunkedAttention | None:
    """The chunking of layer ``layer_number`` (global, 0-based), or None where it attends to the whole sequence."""
    if config.attention_chunk_size is None or config.is_nope_layer(layer_number):
        return None
    return ChunkedAttention(config.attention_chunk_size)
