"""Attention when every rank holds only its chunks of the sequence: the two ways the keys get around.

Each rank holds the queries, keys and values of its two chunks (``sharding.py``: chunks i and
2 cp - 1 - i of 2 cp); a query must still see every key before it. Both variants wrap the layer's own
core attention (``model/dot_product_attention.py``'s DotProductAttention) and keep its interface:
``(query, key, value, attention_mask, prefix, softmax_offset) -> context``, [s/cp, b, heads, d] queries and keys and
[s/cp, b, groups, dv] values in, [s/cp, b, heads x dv] out. Values may be narrower than keys (multi-latent
attention's): keys and values travel together, joined along their channels.

``AllGatherAttention`` (--cp-comm-type all_gather): the keys and values of every rank are all-gathered
(their gradients reduce-scattered back in the backward, ``gather_from_sequence_parallel_region``'s pair)
and each of this rank's chunks attends to the keys up to its own end with the layer's own core, so
every --attention-backend, attention dropout, soft-capping, sliding windows, packed masks and a prefix
work as they do in one process. It keeps the whole sequence's keys and values for the backward.

``RingAttention`` (--cp-comm-type p2p): the keys and values travel around the ring of context-parallel
ranks, one block per step. While a block is attended to, the next is already on its way (posted before,
waited after); each block's output and log-sum-exp are merged with the log-sum-exp rule
(``block_attention.py``). Causality skips whole blocks: a chunk never attends to a later one, and the
chunk order gives every rank and every step the same amount of work. The backward is a ring too: the
key/value blocks come around again, each with the gradient of its keys and values summed over the ranks
that have seen it so far, which ends back at its owner after the last step. Only the rank's own queries,
keys, values, output and log-sum-exp are kept (the activations of one process's attention / cp). There
is no attention dropout here (the configuration refuses it).

Llama 4's chunked layers hand both their ``chunks`` (``model/chunked_attention.py``'s ChunkedAttention) and the
queries' positions: all_gather runs each of the rank's chunks through it at its global columns (chunk by
chunk, folded where the positions are the columns, as one process); the ring also skips the pairs of chunks
whose keys no query reaches and masks the rest by the attention chunks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.context_parallel.block_attention import (CAUSAL, ExplicitBlockAttention, FlashBlockAttention,
                                                            add_sink, causal_mask, merge, sink_gradient)
from megatron_lite.context_parallel.config import ContextParallelConfig
from megatron_lite.context_parallel.sharding import chunk_ids, global_order
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import gather_from_sequence_parallel_region

SKIP = "skip"  # a block pair in which no query sees any key


@dataclass(frozen=True)
class _Masking:
    """What hides keys from this rank's queries besides causality and a sliding window: the given mask
    [b, 1, s/cp, s] (None: none), and Llama 4's attention chunks (a ChunkedAttention, or None) at the queries'
    ``position_ids`` [b, s/cp], which may be known to be their columns."""
    attention_mask: torch.Tensor | None
    chunks: object = None
    position_ids: torch.Tensor | None = None
    positions_are_columns: bool = False


def context_parallel_attention(local_attention: nn.Module, cp: ContextParallelConfig, layer_number: int) -> nn.Module:
    """The layer's core attention under context parallelism, as --cp-comm-type says for this layer."""
    kinds = {"all_gather": AllGatherAttention, "p2p": RingAttention}
    return kinds[cp.comm_type(layer_number)](local_attention, cp)


def _check_mask(attention_mask, local_length: int, cp_size: int) -> None:
    if attention_mask is not None and tuple(attention_mask.shape[-2:]) != (local_length, local_length * cp_size):
        raise ValueError(f"under context parallelism the attention mask holds this rank's {local_length} query rows "
                         f"and all {local_length * cp_size} key columns, [b, 1, {local_length}, "
                         f"{local_length * cp_size}]; got {list(attention_mask.shape)}. Cut the batch with "
                         f"context_parallel.get_batch_on_this_cp_rank.")


class AllGatherAttention(nn.Module):
    def __init__(self, local_attention: nn.Module, cp: ContextParallelConfig):
        super().__init__()
        self.local_attention = local_attention
        self.cp = cp

    def forward(self, query, key, value, attention_mask=None, prefix=None, softmax_offset=None, chunks=None,
                position_ids=None, positions_are_columns=False):
        _check_mask(attention_mask, query.shape[0], self.cp.size)
        key_value = gather_sequence(_join(key, value), self.cp)
        key, value = _split(key_value, key.shape[-1])
        return attend_own_chunks(self.local_attention, query, key, value, attention_mask, self.cp, prefix=prefix,
                                 softmax_offset=softmax_offset, chunks=chunks, position_ids=position_ids,
                                 positions_are_columns=positions_are_columns)


def gather_sequence(tensor: torch.Tensor, cp: ContextParallelConfig) -> torch.Tensor:
    """Every rank's positions [s/cp, ...] all-gathered into the whole sequence [s, ...], in sequence order (the
    gradient reduce-scattered back)."""
    gathered = gather_from_sequence_parallel_region(tensor, cp.cp_group)
    return gathered.index_select(0, global_order(cp.size, tensor.shape[0] // 2).to(gathered.device))


def attend_own_chunks(local_attention: nn.Module, query, key, value, attention_mask, cp: ContextParallelConfig,
                      prefix=None, softmax_offset=None, chunks=None, position_ids=None,
                      positions_are_columns=False) -> torch.Tensor:
    """This rank's queries [s/cp, b, heads, d] (its two chunks) against the whole sequence's keys and values
    [s, b, groups, d], each chunk seeing the keys up to its own end, with the layer's own core attention; a
    ``prefix`` goes before the keys, ``softmax_offset`` (attention sinks) joins each query's one softmax. The mask
    is [b, 1, s/cp, s] (None: causal).

    ``chunks`` (a ``model/chunked_attention.py`` ChunkedAttention, Llama 4's chunked layers) with the queries'
    ``position_ids`` [b, s/cp]: each of the rank's chunks attends chunk by chunk (of the attention's chunks) at
    its global columns, as one process attends, never under a mask over the whole sequence (folded where
    ``positions_are_columns``)."""
    core = functools.partial(local_attention, prefix=prefix)
    if softmax_offset is not None:
        core = functools.partial(core, softmax_offset=softmax_offset)
    chunk = query.shape[0] // 2
    outputs = []
    for half, chunk_id in enumerate(chunk_ids(cp.rank, cp.size)):
        rows, end = slice(half * chunk, (half + 1) * chunk), (chunk_id + 1) * chunk
        # The chunk's queries are the last ``chunk`` of the ``end`` keys it may see: the core's causal
        # mask (and any sliding window) lines them up from the end, after the prefix it puts first.
        mask = None if attention_mask is None else attention_mask[:, :, rows, :end]
        attend = core if chunks is None else functools.partial(chunks, core, position_ids=position_ids[:, rows],
                                                               positions_are_columns=positions_are_columns)
        outputs.append(attend(query[rows], key[:end], value[:end], mask))
    return torch.cat(outputs)


def _join(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Keys and values as one tensor to send, joined along their channels (the last dimension): dk + dv."""
    return torch.cat([key, value], dim=-1)


def _split(key_value: torch.Tensor, key_width: int) -> tuple:
    """``_join`` undone (views)."""
    return key_value[..., :key_width], key_value[..., key_width:]


class _RingExchange:
    """Send ``tensor`` to the next rank of the ring and receive the previous rank's, posted now, ``wait``ed later."""

    def __init__(self, tensor: torch.Tensor, cp: ContextParallelConfig):
        self.received = torch.empty_like(tensor)
        ranks, rank = cp.global_ranks, cp.rank
        self.requests = collectives.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, ranks[(rank + 1) % len(ranks)], group=cp.cp_group),
            dist.P2POp(dist.irecv, self.received, ranks[(rank - 1) % len(ranks)], group=cp.cp_group)])

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


class RingAttention(nn.Module):
    def __init__(self, local_attention: nn.Module, cp: ContextParallelConfig):
        super().__init__()
        self.cp = cp
        scale = local_attention.softmax_scale
        if local_attention.unfused:
            self.kernel = ExplicitBlockAttention(scale, local_attention.logit_capping)
        else:
            self.kernel = FlashBlockAttention(scale)
        window = local_attention.sliding_window
        self.window_left = None if window is None else window.left

    def forward(self, query, key, value, attention_mask=None, prefix=None, softmax_offset=None, chunks=None,
                position_ids=None, positions_are_columns=False):
        """``chunks`` (a ``model/chunked_attention.py`` ChunkedAttention) with the queries' ``position_ids``
        [b, s/cp]: each query sees the keys of its own attention chunk only; blocks of keys out of every query's
        reach are skipped as later ones are, the others take the chunks' mask. Where ``positions_are_columns``
        (known on the host), which blocks some query reaches is decided from the columns, with no mask read
        back from the device."""
        local_length, batch = query.shape[:2]
        _check_mask(attention_mask, local_length, self.cp.size)
        prefix_key = prefix_value = None
        if prefix is not None:
            prefix_key, prefix_value = prefix.keys_and_values(batch, key.dtype)
        masking = _Masking(attention_mask, chunks, position_ids, positions_are_columns)
        return _RingAttentionFunction.apply(query, key, value, prefix_key, prefix_value, softmax_offset, masking,
                                            self)

    def around_the_ring(self, key_value: torch.Tensor):
        """(owner's context-parallel rank, its keys and values) of every rank, this rank's first; the next
        block is on its way while the caller works on this one."""
        for step in range(self.cp.size):
            exchange = _RingExchange(key_value, self.cp) if step < self.cp.size - 1 else None
            yield (self.cp.rank - step) % self.cp.size, key_value
            if exchange is not None:
                key_value = exchange.wait()

    def block_pairs(self, owner: int, masking: _Masking, chunk: int, prefix_length: int, device):
        """(query half, key half, mask) of every pair of this rank's chunks and ``owner``'s that attend."""
        for half, query_chunk in enumerate(chunk_ids(self.cp.rank, self.cp.size)):
            for key_half, key_chunk in enumerate(chunk_ids(owner, self.cp.size)):
                mask = self._mask(masking, half, query_chunk, key_chunk, chunk, prefix_length, device)
                if mask is not SKIP:
                    yield half, key_half, mask

    def prefix_masks(self, chunk: int, prefix_length: int, device):
        """(query half, mask) of this rank's chunks against the prefix (every query sees all of it, windows
        allowing)."""
        for half, query_chunk in enumerate(chunk_ids(self.cp.rank, self.cp.size)):
            mask = self._mask(_Masking(None), half, query_chunk, None, chunk, prefix_length, device)
            if mask is not SKIP:
                yield half, mask

    def _mask(self, masking: _Masking, half: int, query_chunk: int, key_chunk, chunk: int, prefix_length: int,
              device):
        """CAUSAL, None, a bool mask or SKIP for the queries of ``query_chunk`` against the keys of ``key_chunk``
        (None: the prefix, which the attention's chunks leave visible as one process's do). Positions count as
        the one-process core counts them, the prefix first."""
        if key_chunk is not None and key_chunk > query_chunk:
            return SKIP  # causal: a chunk never sees a later one
        chunks = None if key_chunk is None else masking.chunks
        if chunks is not None and chunks.out_of_reach(query_chunk * chunk, (key_chunk + 1) * chunk - 1):
            return SKIP  # every key further back than any of the block's queries sees
        # Positions that are the columns: whether some query sees a key of the block is known here.
        columns_decide = chunks is not None and masking.positions_are_columns and masking.attention_mask is None
        if columns_decide:
            queries, keys = (range(c * chunk, (c + 1) * chunk) for c in (query_chunk, key_chunk))
            if not chunks.reaches(queries, keys):
                return SKIP
            if keys[0] // chunks.chunk_size == queries[-1] // chunks.chunk_size:  # one attention chunk holds both
                chunks = None
        diagonal = key_chunk == query_chunk
        key_start = 0 if key_chunk is None else prefix_length + key_chunk * chunk
        key_length = prefix_length if key_chunk is None else chunk
        masks = [causal_mask(chunk, chunk, device)] if diagonal else []
        if self.window_left is not None:
            # Query i sits at prefix_length + query_chunk * chunk + i, key j at key_start + j: outside the
            # window when their distance exceeds ``left``, i.e. j - i < offset - left.
            offset = prefix_length + query_chunk * chunk - key_start
            masks.append(torch.ones(chunk, key_length, dtype=torch.bool, device=device)
                         .tril(offset - self.window_left - 1))
        rows = slice(half * chunk, (half + 1) * chunk)
        if masking.attention_mask is not None and key_chunk is not None:
            columns = slice(key_chunk * chunk, (key_chunk + 1) * chunk)
            masks.append(masking.attention_mask[:, :, rows, columns])
        if chunks is not None:  # query i of the block sits (query_chunk - key_chunk) chunk + i columns on
            masks.append(chunks.mask(None, masking.position_ids[:, rows], chunk, (query_chunk - key_chunk) * chunk))
        if diagonal and len(masks) == 1:
            return CAUSAL
        if not masks:
            return None
        mask = masks[0]
        for other in masks[1:]:
            mask = mask | other
        return mask if columns_decide else SKIP if bool(mask.all()) else mask


def _halves(tensor: torch.Tensor, chunk: int):
    return tensor[:, :, :chunk], tensor[:, :, chunk:]


def _blocks(tensor):
    """[s, b, heads, d] -> [b, heads, s, d], the kernels' layout (a view)."""
    return None if tensor is None else tensor.permute(1, 2, 0, 3)


def _sequence_first(tensor):
    """[b, heads, s, d] -> [s, b, heads, d] (a view), ``_blocks`` undone."""
    return None if tensor is None else tensor.permute(2, 0, 1, 3)


class _RingAttentionFunction(torch.autograd.Function):
    """Ring attention over [2 chunk, b, heads, d] queries, [2 chunk, b, groups, d] keys and [2 chunk, b, groups, dv]
    values, with an optional [p, b, groups, d or dv] prefix seen by every query and optional sinks [heads] (joined
    after the last block, ``add_sink``); returns [2 chunk, b, heads x dv], which is also what the backward keeps of
    the output (the output projection keeps the same tensor)."""

    @staticmethod
    def forward(ctx, *inputs):
        query, key, value, prefix_key, prefix_value = map(_blocks, inputs[:5])
        softmax_offset, masking, ring = inputs[5:]
        chunk = query.shape[2] // 2
        prefix_length = 0 if prefix_key is None else prefix_key.shape[2]
        queries = _halves(query, chunk)
        out = [torch.zeros(*q.shape[:3], value.shape[-1], dtype=torch.float32, device=q.device) for q in queries]
        lse = [torch.full(q.shape[:3], float("-inf"), device=q.device) for q in queries]

        def attend(half, block_key, block_value, mask):
            block_out, block_lse = ring.kernel.forward(queries[half], block_key, block_value, mask)
            out[half], lse[half] = merge(out[half], lse[half], block_out, block_lse)

        for half, mask in ring.prefix_masks(chunk, prefix_length, query.device) if prefix_key is not None else ():
            attend(half, prefix_key, prefix_value, mask)
        for owner, key_value in ring.around_the_ring(_join(key, value)):
            for half, key_half, mask in ring.block_pairs(owner, masking, chunk, prefix_length, query.device):
                attend(half, *_split(_halves(key_value, chunk)[key_half], key.shape[-1]), mask)
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        if softmax_offset is not None:
            out, lse = add_sink(out, lse, softmax_offset)
        out = _sequence_first(out.to(query.dtype))
        out = out.reshape(out.shape[0], out.shape[1], -1)
        ctx.save_for_backward(*inputs[:6], out, lse)
        ctx.masking, ctx.ring = masking, ring
        return out

    @staticmethod
    def backward(ctx, grad_out):
        *inputs, softmax_offset, out, lse = ctx.saved_tensors
        query, key, value, prefix_key, prefix_value = map(_blocks, inputs)
        heads = query.shape[1]
        out, grad_out = (_blocks(t.reshape(t.shape[0], t.shape[1], heads, -1)) for t in (out, grad_out))
        grad_offset = None if softmax_offset is None else sink_gradient(grad_out, out, lse, softmax_offset).to(
            softmax_offset.dtype)
        ring, masking = ctx.ring, ctx.masking
        chunk = query.shape[2] // 2
        prefix_length = 0 if prefix_key is None else prefix_key.shape[2]
        queries, grad_outs, outs, lses = (_halves(t, chunk) for t in (query, grad_out, out, lse))
        grad_query = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in queries]

        def backward_of(half, block_key, block_value, mask):
            grad_q, grad_k, grad_v = ring.kernel.backward(grad_outs[half], queries[half], block_key, block_value,
                                                          outs[half], lses[half], mask)
            grad_query[half] += grad_q
            return grad_k.float(), grad_v.float()

        grad_prefix = None
        if prefix_key is not None:
            grad_prefix = [torch.zeros(prefix_key.shape, dtype=torch.float32, device=query.device) for _ in range(2)]
            for half, mask in ring.prefix_masks(chunk, prefix_length, query.device):
                for grad, block_grad in zip(grad_prefix, backward_of(half, prefix_key, prefix_value, mask)):
                    grad += block_grad
        received = None  # the gradient of the block in hand, from the ranks that saw it before this one
        width = key.shape[-1]
        for owner, key_value in ring.around_the_ring(_join(key, value)):
            grad_key_value = torch.zeros(key_value.shape, dtype=torch.float32, device=key_value.device)
            for half, key_half, mask in ring.block_pairs(owner, masking, chunk, prefix_length, query.device):
                grad_k, grad_v = backward_of(half, *_split(_halves(key_value, chunk)[key_half], width), mask)
                grad_key_block, grad_value_block = _split(_halves(grad_key_value, chunk)[key_half], width)
                grad_key_block.add_(grad_k)
                grad_value_block.add_(grad_v)
            if received is not None:
                grad_key_value += received.wait()
            received = _RingExchange(grad_key_value, ring.cp)  # on to the next rank, which holds this block next
        # The own block's, summed over every rank: it went all the way round.
        grad_key, grad_value = _split(received.wait(), width)
        grad_prefix_key, grad_prefix_value = (None, None) if grad_prefix is None else (
            _sequence_first(grad.to(prefix_key.dtype)) for grad in grad_prefix)
        grad_query = torch.cat(grad_query, dim=2).to(query.dtype)
        return (_sequence_first(grad_query), _sequence_first(grad_key.to(key.dtype)),
                _sequence_first(grad_value.to(value.dtype)), grad_prefix_key, grad_prefix_value, grad_offset, None,
                None)
