"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

A column-parallel linear splits its output features over the tensor-parallel
ranks; a row-parallel linear splits its input features. Chained (column then
row, as in attention and the MLP), the intermediate activation never needs
communicating: one all-reduce after the row layer in the forward pass and one
before the column layer in the backward pass. With sequence parallelism these
become an all-gather of the sequence before the column layer and a
reduce-scatter after the row layer.

Parameters are allocated but not initialised: the model builder initialises
each FULL parameter the same way for every layout and keeps this rank's shard
(``shard_tensor``), guided by the attributes set here:
``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel.config import TensorParallelConfig
from megatron_lite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)


def set_tensor_model_parallel_attributes(param: torch.Tensor, *, is_parallel: bool, partition_dim: int = 0,
                                         partition_stride: int = 1) -> None:
    """Record how ``param`` is sharded, for initialisation, checkpoints and the gradient norm."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) does not split evenly over {denominator} tensor-parallel ranks.")
    return numerator // denominator


def shard_tensor(full: torch.Tensor, *, partition_dim: int, partition_stride: int = 1, rank: int,
                 world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a full tensor.

    With stride s the full tensor is s blocks along ``partition_dim`` (e.g. the
    fused SwiGLU [gate; up]) and each block is split over the ranks, so shard r
    is [block_0 chunk r; ...; block_{s-1} chunk r]: every rank gets matching
    halves of gate and up.
    """
    blocks = full.chunk(partition_stride, dim=partition_dim)
    _divide(full.size(partition_dim), partition_stride * world_size, f"dimension {partition_dim} of a parameter")
    return torch.cat([block.chunk(world_size, dim=partition_dim)[rank] for block in blocks],
                     dim=partition_dim).contiguous()


def gather_shards(shards: Sequence[torch.Tensor], *, partition_dim: int, partition_stride: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order; inverse of ``shard_tensor``."""
    pieces = [shard.chunk(partition_stride, dim=partition_dim) for shard in shards]
    blocks = [torch.cat([p[k] for p in pieces], dim=partition_dim) for k in range(partition_stride)]
    return torch.cat(blocks, dim=partition_dim)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output rows: this rank computes Y's slice.

    Args:
        input_size: Input features (full).
        output_size: Output features (full); this rank holds output_size / tp.
        tp_config: The tensor-parallel group and parameter dtype; with ``sequence_parallel`` the
            input is [s/tp, b, h], all-gathered along the sequence first.
        bias: Add a (sharded) bias.
        gather_output: All-gather the output features so every rank has all of Y.
        partition_stride: 2 for fused [gate; up] weights (see ``shard_tensor``).
        skip_bias_add: Return the bias instead of adding it, so a fused kernel can.
        skip_weight_param_allocation: No weight of its own; ``forward`` must be given one
            (the output layer tied to the word embedding).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_config: TensorParallelConfig, bias: bool = True,
                 gather_output: bool = False, partition_stride: int = 1, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False):
        super().__init__()
        tp_group, sequence_parallel, params_dtype = (tp_config.tp_group, tp_config.sequence_parallel,
                                                     tp_config.params_dtype)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel; "
                             "the sequence-parallel output stays sharded for the row-parallel layer that follows.")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        world_size = collectives.world_size(tp_group)
        self.output_size_per_partition = _divide(output_size, world_size, "ColumnParallelLinear output size")
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, partition_dim=0,
                                                 partition_stride=partition_stride)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, partition_dim=0,
                                                 partition_stride=partition_stride)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """x: [s, b, input_size] ([s/tp, b, input_size] with sequence parallelism).

        Returns (output, bias): output [s, b, output_size / tp] (or output_size with
        gather_output); bias is returned only with skip_bias_add, else None.
        """
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation=True; "
                                 "pass the weight to forward (the tied word-embedding weight).")
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"ColumnParallelLinear: weight shape {tuple(weight.shape)} does not match the expected "
                             f"{(self.output_size_per_partition, self.input_size)}.")
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        output = F.linear(x, weight, bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input columns: ranks' partial products are summed.

    Args:
        input_size: Input features (full); this rank holds input_size / tp.
        output_size: Output features (full).
        tp_config: The tensor-parallel group and parameter dtype; with ``sequence_parallel`` the
            output is reduce-scattered along the sequence instead of all-reduced.
        bias: Add a bias, replicated on every rank and added after the reduction.
        input_is_parallel: The input is already split along its last dim (the
            output of a column-parallel layer); otherwise split it here.
        skip_bias_add: Return the bias instead of adding it.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_config: TensorParallelConfig, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False):
        super().__init__()
        tp_group, sequence_parallel, params_dtype = (tp_config.tp_group, tp_config.sequence_parallel,
                                                     tp_config.params_dtype)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True "
                             "(the input comes from a column-parallel layer).")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        world_size = collectives.world_size(tp_group)
        self.input_size_per_partition = _divide(input_size, world_size, "RowParallelLinear input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, partition_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=False)
            # Under sequence parallelism each rank adds the bias to its own slice of the
            # sequence, so its gradient is partial and must be all-reduced over tp.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.bias = None

    def forward(self, x: torch.Tensor):
        """x: [s, b, input_size / tp] (or input_size when not input_is_parallel).

        Returns (output, bias): output [s, b, output_size] ([s/tp, b, output_size]
        with sequence parallelism); bias is returned only with skip_bias_add.
        """
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        output = F.linear(x, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output, self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the vocabulary split over tensor-parallel ranks.

    Each rank looks up the ids it owns and writes zeros for the rest; summing over
    ranks (all-reduce, or reduce-scatter along the sequence with sequence
    parallelism) gives every token its row.

    Args:
        num_embeddings: Vocabulary size (padded, divisible by the tensor-parallel size).
        embedding_dim: Hidden size.
        tp_config: The tensor-parallel group and parameter dtype; with ``sequence_parallel`` the
            output is [s/tp, b, h] instead of [s, b, h].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_config: TensorParallelConfig):
        super().__init__()
        tp_group, sequence_parallel, params_dtype = (tp_config.tp_group, tp_config.sequence_parallel,
                                                     tp_config.params_dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        world_size = collectives.world_size(tp_group)
        per_partition = _divide(num_embeddings, world_size, "the padded vocabulary size")
        self.vocab_start_index = collectives.rank(tp_group) * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = nn.Parameter(torch.empty(per_partition, embedding_dim, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, partition_dim=0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [s, b] token ids. Returns [s, b, h] ([s/tp, b, h] with sequence parallelism)."""
        if self.tp_group is None:
            output = F.embedding(input_ids, self.weight)
        else:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
            output = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)
