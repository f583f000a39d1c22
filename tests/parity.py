"""Comparing a parallel run with the single-process run: one tolerance, one way to put shards together.

A rank reports its parameters (or gradients) with ``rank_tensors``; ``full_tensors`` reassembles them
from the tensor-parallel shards of every rank, checking that data-parallel replicas agree exactly; and
``assert_relative_close`` compares a whole tensor (or a list of losses) with the reference.
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_lite.tensor_parallel import gather_shards


def assert_relative_close(actual, expected, rel: float = 1e-5, what: str = "") -> None:
    """max |actual - expected| <= rel * max |expected|: relative to the tensor's scale, so
    elements that happen to be near zero do not demand absolute agreement."""
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= rel * scale, f"{what}: max error {error:.3g} exceeds {rel:g} x scale {scale:.3g}"


def tensor_parallel_split(param) -> tuple:
    """(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``): how ``gather_shards`` puts
    the parameter's shards together."""
    return (getattr(param, "tensor_model_parallel", False), getattr(param, "partition_dim", 0),
            getattr(param, "partition_stride", 1))


def rank_tensors(named_parameters, value=lambda param: param) -> dict:
    """name -> (float32 numpy copy of ``value(param)``, ``tensor_parallel_split(param)``). Numpy, because
    a tensor returned from a rank would travel through shared memory that dies with it."""
    return {name: (value(param).detach().float().numpy().copy(), tensor_parallel_split(param))
            for name, param in named_parameters}


def full_tensors(rank_results: list) -> dict:
    """name -> whole tensor from each rank's ``{"tensors": rank_tensors(...), "tp_rank": ...}``, where a tensor
    split over another group names its shard in ``"shard_ranks"`` (an expert's, its expert-tensor rank).

    The data-parallel replicas of each shard (the ranks reporting the same shard) must agree exactly."""
    by_name: dict = {}
    for result in rank_results:
        for name, (array, split) in result["tensors"].items():
            shard = result.get("shard_ranks", {}).get(name, result["tp_rank"])
            by_name.setdefault(name, {}).setdefault(shard, []).append((array, split))
    full = {}
    for name, per_tp in by_name.items():
        for replicas in per_tp.values():
            for array, _ in replicas[1:]:
                np.testing.assert_array_equal(array, replicas[0][0], err_msg=f"{name}: replicas differ")
        (parallel, dim, stride) = per_tp[min(per_tp)][0][1]
        if parallel:
            full[name] = gather_shards([torch.from_numpy(per_tp[t][0][0]) for t in sorted(per_tp)],
                                       partition_dim=dim, partition_stride=stride)
        else:
            full[name] = torch.from_numpy(per_tp[min(per_tp)][0][0])
    return full


def assert_losses_match(per_rank_losses: list, reference: list, steps: int, what: str, rel: float = 1e-5) -> None:
    """Every rank that reports losses (the last pipeline stage) reports ``steps`` of them, each within
    ``rel`` of the single-process run's; at least one rank reports."""
    reporting = [losses for losses in per_rank_losses if losses]
    assert reporting, f"{what}: no rank reported losses"
    for losses in reporting:
        assert len(losses) == steps, f"{what}: {len(losses)} losses, expected {steps}"
        assert_relative_close(losses, reference, rel=rel, what=f"{what} losses")
