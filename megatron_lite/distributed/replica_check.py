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


def weight_hash(model_chunks, experts: bool | None = None) -> int:
    """A 63-bit digest of every parameter's bytes, in state-dict order; ``experts`` True or False: of the
    expert weights (``expert_parallel``) or the others only."""
    digest = hashlib.sha256()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if experts is not None and getattr(param, "expert_parallel", False) != experts:
                continue
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def check_weight_hash_across_dp_replicas(model_chunks, parallel_state: ParallelState, iteration: int) -> None:
    """Expert weights, where they have groups of their own, are compared over the expert-data-parallel
    group (the ranks holding the same experts), the rest over the data x context-parallel one (context-parallel
    ranks hold whole replicas too)."""
    for chunk in model_chunks:  # weights must be final: finish any overlapped all-gather first
        chunk.finish_param_sync()
    dense = "data_context" if "data_context" in parallel_state.group_ranks else "data"
    if not parallel_state.splits_experts:
        _compare(weight_hash(model_chunks), parallel_state.data_parallel_group_with_context, dense, parallel_state,
                 iteration)
        return
    _compare(weight_hash(model_chunks, experts=False), parallel_state.data_parallel_group_with_context, dense,
             parallel_state, iteration)
    _compare(weight_hash(model_chunks, experts=True), parallel_state.expert_data_parallel_group, "expert_data",
             parallel_state, iteration)


def _compare(digest: int, group, name: str, parallel_state: ParallelState, iteration: int) -> None:
    if group is None:
        return
    local = torch.tensor([digest], dtype=torch.int64, device=collectives.reduction_device([group]))
    hashes = torch.empty(collectives.world_size(group), dtype=torch.int64, device=local.device)
    collectives.all_gather_into_tensor(hashes, local, group)
    hashes = hashes.tolist()
    if len(set(hashes)) > 1:
        ranks = parallel_state.group_ranks[name]
        disagreeing = [rank for rank, h in zip(ranks, hashes) if h != hashes[0]]
        kind = "expert-data-parallel" if name == "expert_data" else "data-parallel"
        raise RuntimeError(
            f"{kind} replicas disagree at iteration {iteration}: the weights on global ranks "
            f"{disagreeing} differ from rank {ranks[0]}'s ({kind} group {ranks}). Training would "
            "silently diverge; check for faulty hardware or nondeterministic kernels, and resume from the "
            "last checkpoint.")
