"""Autograd mappings that move tokens between the ranks of a mixture-of-experts layer.

Tokens are rows of a [tokens, hidden] tensor, and the number each rank holds is uneven: it is
however many the router sent there. Each mapping is one half of a conjugate pair, as in
``tensor_parallel/mappings.py``:

    all_to_all               rows to the ranks holding their experts   <->  the same, back
    gather_rows              every rank's rows, concatenated           <->  reduce-scatter (partial
                                                                            gradients) or keep own rows
    reduce_scatter_rows      sum partial rows, keep this rank's        <->  gather
    split_rows               keep this rank's rows of a replicated     <->  gather
                             tensor

``sizes[r]`` is rank r's number of rows; the collectives pad every rank's rows to the largest
(all-gather and reduce-scatter need equal pieces) and cut the padding off again. A group of
``None`` (one rank) makes every mapping the identity.
"""
from __future__ import annotations

import torch

from megatron_lite.process_groups import collectives


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _gather(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    most = max(sizes)
    gathered = x.new_empty((most * len(sizes), *x.shape[1:]))
    collectives.all_gather_into_tensor(gathered, _padded(x, most), group)
    return torch.cat([gathered[r * most:r * most + size] for r, size in enumerate(sizes)])


def _reduce_scatter(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    most = max(sizes)
    pieces = x.split(sizes)
    output = x.new_empty((most, *x.shape[1:]))
    collectives.reduce_scatter_tensor(output, torch.cat([_padded(p, most) for p in pieces]), group)
    return output[:sizes[collectives.rank(group)]]


def _own(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    return x.split(sizes)[collectives.rank(group)].contiguous()


def _all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    output = x.new_empty((sum(output_splits), *x.shape[1:]))
    collectives.all_to_all_single(output, x, group, output_split_sizes=output_splits, input_split_sizes=input_splits)
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, ctx.group, input_splits, output_splits), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, partial_grads):
        ctx.sizes, ctx.group, ctx.partial_grads = sizes, group, partial_grads
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grads:
            return _reduce_scatter(grad, ctx.sizes, ctx.group), None, None, None
        return _own(grad, ctx.sizes, ctx.group), None, None, None


class _OwnRows(torch.autograd.Function):
    """Forward: this rank's rows, of the sum over ranks (``reduce``) or of a tensor all hold. Backward: gather."""

    @staticmethod
    def forward(ctx, x, sizes, group, reduce):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter(x, sizes, group) if reduce else _own(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.sizes, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, group, *, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Send ``input_splits[j]`` rows (in order) to rank j, receive ``output_splits[j]`` from it."""
    return x if group is None else _AllToAll.apply(x, group, output_splits, input_splits)


def gather_rows(x: torch.Tensor, sizes: list[int], group, *, partial_grads: bool) -> torch.Tensor:
    """Every rank's rows in rank order. ``partial_grads``: each rank's gradient of the result is a partial
    sum (it feeds a weight shard), so the backward reduce-scatters; otherwise every rank computed the
    whole gradient, and keeps its own rows of it."""
    return x if group is None else _GatherRows.apply(x, sizes, group, partial_grads)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum every rank's ``x`` (rows ``sizes[0]``, ``sizes[1]``, ...) and keep this rank's rows."""
    return x if group is None else _OwnRows.apply(x, sizes, group, True)


def split_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """This rank's rows of a tensor every rank holds whole."""
    return x if group is None else _OwnRows.apply(x, sizes, group, False)
