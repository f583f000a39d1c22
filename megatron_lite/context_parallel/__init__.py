"""Context parallelism: every sequence split over the context-parallel ranks, for every activation.

A rank holds two of the sequence's 2 x cp chunks (one early, one late, which balances causal
attention) from the embedding to the loss. Everything but attention works on its own positions; attention
needs the keys and values of the earlier positions, which the ranks exchange. The loss is summed over
each rank's tokens and the gradients of the context-parallel ranks are reduced together with the
data-parallel ones (docs/parallelism.md).

    sharding.py          which positions a rank holds; a micro-batch cut down to them
    config.py            ContextParallelConfig: what the attention layers are told
    attention.py         attention across the ranks: all-gathered keys and values, or a ring (p2p)
    block_attention.py   one block of keys: output and log-sum-exp, the merge rule, the backward
"""
from megatron_lite.context_parallel.attention import attend_own_chunks, context_parallel_attention, gather_sequence
from megatron_lite.context_parallel.config import ContextParallelConfig
from megatron_lite.context_parallel.sharding import get_batch_on_this_cp_rank, local_positions, slice_batches

__all__ = ["ContextParallelConfig", "attend_own_chunks", "context_parallel_attention", "gather_sequence",
           "get_batch_on_this_cp_rank", "local_positions", "slice_batches"]
