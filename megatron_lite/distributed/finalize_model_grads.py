"""Everything that must happen to gradients between the last backward and the optimizer step.

1. Finish the data-parallel reduction of every model chunk.
2. Under sequence parallelism, norm weights and biases see only this rank's part of
   the sequence: their gradients are summed over the tensor-parallel group.
3. The tied word embedding lives on the first and the last pipeline stage: each
   holds half of its gradient, summed over the embedding group.
4. With a per-token loss (``num_tokens`` given), backward ran from loss *sums*:
   divide by the number of loss tokens in the whole global batch (every data-parallel
   replica's and every context-parallel rank's share).

Steps 2 and 3 are element-wise sums, so they act on each rank's ``param_slices()``
only: its shards under a sharding strategy (where only those hold averaged
gradients after step 1). Tensor-parallel peers have identical buffer layouts, and
the shared embedding sits in a bucket of its own so both stages shard it identically.
"""
from __future__ import annotations

import torch

from megatron_lite.process_groups import collectives


def _all_reduce_coalesced(grads: list, group) -> None:
    """One collective for many small gradients, on a device the group can reduce (gradient
    shards may live in host memory under --grad-cpu-offload)."""
    if not grads or group is None:
        return
    device = collectives.reduction_device([group])
    if len(grads) == 1 and grads[0].device == device:
        collectives.all_reduce(grads[0], group)
        return
    flat = torch.cat([g.reshape(-1).to(device) for g in grads])
    collectives.all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_model_grads(model_chunks: list, num_tokens: torch.Tensor | None = None, *, parallel_state) -> None:
    """Make the gradient of every ``param_slices()`` entry of ``model_chunks`` (DistributedDataParallel) final.

    ``num_tokens``: the loss tokens this rank's last pipeline stage counted, for a per-token loss
    (Megatron-Core's ``calculate_per_token_loss``); None when each micro-batch's loss was a mean."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()

    slices = [s for chunk in model_chunks for s in chunk.param_slices()]
    sequence_parallel = [s.grad for s in slices if getattr(s.param, "sequence_parallel", False)]
    _all_reduce_coalesced(sequence_parallel, parallel_state.tensor_model_parallel_group)

    if parallel_state.pipeline_model_parallel_world_size > 1 and parallel_state.is_in_embedding_group():
        shared = [s.grad for s in slices if getattr(s.param, "shared_embedding", False)]
        _all_reduce_coalesced(shared, parallel_state.embedding_group)

    if num_tokens is not None:
        _divide_by_global_token_count(model_chunks, num_tokens, parallel_state)


def _divide_by_global_token_count(model_chunks: list, num_tokens: torch.Tensor, parallel_state) -> None:
    # Only the last stage counted the tokens; the others learn the count from it, then the replicas (and the
    # context-parallel ranks, each with its own positions) add theirs.
    num_tokens = num_tokens.clone()
    collectives.broadcast(num_tokens, src=parallel_state.group_ranks["pipeline"][-1],
                          group=parallel_state.pipeline_model_parallel_group)
    reduced_over = parallel_state.data_parallel_group_with_context
    collectives.all_reduce(num_tokens, reduced_over)
    # The gradient reduction averaged over data x context ranks (x 1/(dp cp)); a sum over the batch is wanted.
    factor = collectives.world_size(reduced_over) / num_tokens.clamp(min=1).double()
    for chunk in model_chunks:
        chunk.scale_gradients(factor)
