"""Autograd mappings into and out of tensor-parallel regions.

Each mapping is one half of a conjugate pair: what one does in the forward pass
its partner does in the backward pass (copy <-> all-reduce, split <-> all-gather,
all-gather <-> reduce-scatter). Layers compose them, so a layer's communication
reads as two calls at its edges.

Activations are [sequence, batch, hidden]: tensor-parallel splits are along the
last dimension, sequence-parallel splits along dim 0. A group of ``None`` (one
rank) makes every mapping the identity, so single-process runs use the same code.
"""
from __future__ import annotations

import torch

from megatron_lite.process_groups import collectives


def _split_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal chunk of ``x`` along ``dim`` (no communication)."""
    world_size = collectives.world_size(group)
    if x.size(dim) % world_size != 0:
        raise ValueError(f"cannot split dimension {dim} of size {x.size(dim)} into {world_size} equal parts, one "
                         f"per rank of the tensor-parallel group.")
    return x.chunk(world_size, dim=dim)[collectives.rank(group)].contiguous()


def _gather_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = collectives.world_size(group)
    output = x.new_empty((x.size(0) * world_size,) + tuple(x.shape[1:]))
    collectives.all_gather_into_tensor(output, x.contiguous(), group)
    return output


def _gather_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    # all_gather_into_tensor concatenates along dim 0, so gather with the last dim moved to the front.
    return _gather_along_first_dim(x.movedim(-1, 0), group).movedim(0, -1).contiguous()


def _reduce_scatter_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = collectives.world_size(group)
    if x.size(0) % world_size != 0:
        raise ValueError(f"cannot reduce-scatter dimension 0 of size {x.size(0)} over the {world_size} ranks of the "
                         f"tensor-parallel group: the size must be a multiple of the group size.")
    output = x.new_empty((x.size(0) // world_size,) + tuple(x.shape[1:]))
    collectives.reduce_scatter_tensor(output, x.contiguous(), group)
    return output


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # Out of place: autograd may still need the input (or other consumers may read the gradient).
    output = x.clone()
    collectives.all_reduce(output, group)
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (every rank's partial input gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum the partial outputs). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence. Backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence.

    Backward: reduce-scatter when the gathered tensor feeds a tensor-parallel
    layer (each rank holds a partial gradient of the full sequence), or just keep
    this rank's slice when every rank computed the same full gradient.
    """

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return _split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: sum partial outputs and keep this rank's sequence slice. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    if group is None:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceScatterToSequenceParallelRegion.apply(x, group)
