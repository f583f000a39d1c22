"""--check-weight-hash-across-dp-replicas-interval: do the data-parallel replicas still agree?

Every data-parallel rank must hold bit-identical weights; if one drifts (a missed
all-gather, a nondeterministic kernel, a flipped bit on a bad GPU) training silently
diverges. Each rank hashes its weights, the hashes are all-gathered over the
data-parallel group, and every rank raises the same error when they differ, so no
rank is left waiting in the next collective.
"""
import hashlib

import torch

from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.parallel_state import ParallelState


def weight_hash(model_chunks) -> int:
    """A 63-bit digest of every parameter's bytes, in state-dict order."""
    digest = hashlib.sha256()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def check_weight_hash_across_dp_replicas(model_chunks, parallel_state: ParallelState, iteration: int) -> None:
    # Context-parallel ranks hold whole replicas of the weights too.
    group = parallel_state.data_parallel_group_with_context
    if group is None:
        return
    for chunk in model_chunks:  # weights must be final: finish any overlapped all-gather first
        chunk.finish_param_sync()
    local = torch.tensor([weight_hash(model_chunks)], dtype=torch.int64,
                         device=collectives.reduction_device([group]))
    hashes = torch.empty(collectives.world_size(group), dtype=torch.int64, device=local.device)
    collectives.all_gather_into_tensor(hashes, local, group)
    hashes = hashes.tolist()
    if len(set(hashes)) > 1:
        ranks = parallel_state.group_ranks.get("data_context", parallel_state.group_ranks["data"])
        disagreeing = [rank for rank, h in zip(ranks, hashes) if h != hashes[0]]
        raise RuntimeError(
            f"data-parallel replicas disagree at iteration {iteration}: the weights on global ranks "
            f"{disagreeing} differ from rank {ranks[0]}'s (data-parallel group {ranks}). Training would "
            "silently diverge; check for faulty hardware or nondeterministic kernels, and resume from the "
            "last checkpoint.")
