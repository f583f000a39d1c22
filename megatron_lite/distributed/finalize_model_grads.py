"""Everything that must happen to gradients between the last backward and the optimizer step.

1. Finish the data-parallel reduction of every model chunk.
2. Under sequence parallelism, norm weights and biases see only this rank's part of
   the sequence: their gradients are summed over the tensor-parallel group.
3. The tied word embedding lives on the first and the last pipeline stage: each
   holds half of its gradient, summed over the embedding group.
4. Under --calculate-per-token-loss the gradients are sums over tokens (the data-parallel
   reduction summed without averaging): divide them by the global number of loss tokens,
   counted on the last stage, sent to the other stages and summed over data-parallel ranks.

Steps 2 and 3 are element-wise sums, so under the distributed optimizer (where
only this rank's shard of ``main_grad`` is meaningful after step 1) they stay
correct: tensor-parallel peers have identical buffer layouts, and the shared
embedding sits in a bucket of its own so both stages shard it identically.
"""
from __future__ import annotations

import torch

from megatron_lite.process_groups import collectives


def _all_reduce_coalesced(grads: list, group) -> None:
    """One collective for many small gradients."""
    if not grads or group is None:
        return
    if len(grads) == 1:
        collectives.all_reduce(grads[0], group)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    collectives.all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_model_grads(model_chunks: list, parallel_state, num_tokens: torch.Tensor | None = None) -> None:
    """Make every ``param.main_grad`` of ``model_chunks`` (DistributedDataParallel) final.

    ``num_tokens``: this rank's loss-token count under --calculate-per-token-loss (0 off the last stage)."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()

    params = [p for chunk in model_chunks for p in chunk.module.parameters() if p.requires_grad]
    sequence_parallel = [p.main_grad for p in params if getattr(p, "sequence_parallel", False)]
    _all_reduce_coalesced(sequence_parallel, parallel_state.tensor_model_parallel_group)

    if parallel_state.pipeline_model_parallel_world_size > 1 and parallel_state.is_in_embedding_group():
        shared = [p.main_grad for p in params if getattr(p, "shared_embedding", False)]
        _all_reduce_coalesced(shared, parallel_state.embedding_group)

    if num_tokens is not None:
        global_tokens = global_num_tokens(num_tokens, parallel_state)
        for chunk in model_chunks:
            chunk.scale_gradients(1.0 / max(global_tokens, 1))


def global_num_tokens(num_tokens: torch.Tensor, parallel_state) -> int:
    """The global batch's loss tokens: the last stage's count, summed over data-parallel ranks."""
    total = num_tokens.detach().to(torch.int64).reshape(1).clone()
    last_stage = parallel_state.group_ranks["pipeline"][-1]
    collectives.broadcast(total, src=last_stage, group=parallel_state.pipeline_model_parallel_group)
    collectives.all_reduce(total, parallel_state.data_parallel_group)
    return int(total.item())
