"""The global gradient norm over a model split across ranks, and clipping by it.

The norm must equal the single-process norm of the full model's gradients, so
every gradient element is counted exactly once across the model-parallel ranks:

- a tensor-parallel shard is a distinct piece of its parameter: every shard counts;
- a parameter replicated over tensor-parallel ranks (norm weights, row-parallel
  biases) has the same gradient on each: only tensor-parallel rank 0 counts it;
- the tied word embedding lives on the first and the last pipeline stage with the
  same (all-reduced) gradient: only the first stage counts it.

Each rank sums the p-th powers of its gradients in fp32; one all-reduce over the
model-parallel group (and over the data-parallel group when the distributed
optimizer has sharded the gradients) adds up the rest of the model.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives
from megatron_lite.config import ConfigError


def get_grads_for_norm(params, *, tensor_model_parallel_rank: int, is_pipeline_first_stage: bool) -> list:
    """The gradients of ``params`` that this rank contributes to the global norm.

    Args:
        params: parameters (or main parameters carrying the same attributes).
        tensor_model_parallel_rank: this rank's position in its tensor-parallel group.
        is_pipeline_first_stage: whether this rank holds the first pipeline stage.

    Returns:
        ``param.main_grad`` where a parameter has one (the fp32 gradient buffer of
        the data-parallel wrapper), else ``param.grad``; parameters without a
        gradient are left out.
    """
    grads = []
    for param in params:
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is None:
            continue
        if not getattr(param, "tensor_model_parallel", False) and tensor_model_parallel_rank != 0:
            continue
        if getattr(param, "shared_embedding", False) and not is_pipeline_first_stage:
            continue
        grads.append(grad)
    return grads


def _all_reduce(tensor: torch.Tensor, groups: list, op) -> None:
    for group in groups:
        collectives.all_reduce(tensor, group, op=op)


def get_grad_norm_fp32(grads_for_norm: list, *, model_parallel_group, data_parallel_group=None,
                       norm_type: float = 2.0) -> float:
    """The ``norm_type``-norm of all ranks' ``grads_for_norm`` taken together.

    Args:
        grads_for_norm: this rank's gradients, from :func:`get_grads_for_norm`.
        model_parallel_group: the tensor- and pipeline-parallel ranks of one model replica.
        data_parallel_group: pass it only when each data-parallel rank holds a
            different shard of the gradients (distributed optimizer); replicated
            gradients must not be summed over data-parallel ranks.
        norm_type: p of the p-norm; ``math.inf`` for the max norm.

    Returns:
        The same float on every rank of the groups.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0 for L2, math.inf for max), got {norm_type}.")
    groups = [model_parallel_group, data_parallel_group]
    # Each gradient's share is computed where the gradient lives (the host under
    # --optimizer-cpu-offload) and summed where the groups communicate.
    device = collectives.reduction_device(groups)
    total = torch.zeros((), dtype=torch.float32, device=device)
    if norm_type == math.inf:
        for grad in grads_for_norm:
            total = torch.maximum(total, grad.detach().abs().max().to(device=device, dtype=torch.float32))
        _all_reduce(total, groups, dist.ReduceOp.MAX)
        return total.item()
    for grad in grads_for_norm:
        total += (torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float32) ** norm_type).to(device)
    _all_reduce(total, groups, dist.ReduceOp.SUM)
    return total.item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(grads: list, max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place so their global norm ``total_norm`` becomes at most ``max_norm``.

    ``grads`` are all of this rank's gradients, duplicates included: every copy
    of a replicated gradient must be scaled alike, though only one was counted.
    """
    if not max_norm > 0:
        raise ConfigError(f"--clip-grad must be positive to clip (0 disables clipping), got {max_norm}.")
    # The 1e-6 keeps an all-zero gradient from dividing by zero (as torch's clip_grad_norm_).
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def count_zeros_fp32(grads_for_norm: list, *, model_parallel_group, data_parallel_group=None) -> int:
    """How many gradient elements are exactly zero across the model (``--log-num-zeros-in-grad``)."""
    groups = [model_parallel_group, data_parallel_group]
    # Counted in int64: a float32 count stops being exact past 2**24 elements.
    device = collectives.reduction_device(groups)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for grad in grads_for_norm:
        total += (grad.numel() - torch.count_nonzero(grad)).to(device)
    _all_reduce(total, groups, dist.ReduceOp.SUM)
    return int(total.item())
