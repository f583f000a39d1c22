"""LoRA (Hu et al. 2021) on a column- or row-parallel linear: y = W x + (alpha / r) B A dropout(x).

W stays frozen; A (r x in) starts Kaiming-uniform as in Hugging Face PEFT and B
(out x r) at zero, so the adapted model starts as the base model. Under tensor
parallelism the factors follow the layer they adapt (docs/reference.md section 9):

    column-parallel W (output split):  A replicated,            B split by output rows
    row-parallel W (input split):      A split by input columns, B replicated
    replicated W (multi-latent attention's down-projections):  A and B replicated

which is a column-parallel B after a replicated A, and a row-parallel A before a
replicated B: the r-wide activation between the two is what is communicated
(copy / all-reduce, or all-gather / reduce-scatter under sequence parallelism),
never anything hidden-sized. The column case all-reduces the r-wide gradient in
backward, so A's gradient is complete on every rank; the replicated factor's
gradient is partial only under sequence parallelism, where ``finalize_model_grads``
sums it over the tensor-parallel group like a norm weight's.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.expert_parallel import ExpertLinear
from megatron_lite.tensor_parallel import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                           TensorParallelConfig)
from megatron_lite.tensor_parallel.random import get_rng_tracker


def kaiming_uniform(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """PEFT's (and nn.Linear's) default: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)


def zeros(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    return torch.zeros(shape)


class LoRA(nn.Module):
    """The low-rank branch of one base linear; ``forward(x)`` is what gets added to the base's output.

    Args:
        base: the ColumnParallelLinear, RowParallelLinear or ReplicatedLinear it adapts (its input and output
            sizes, tensor-parallel group, sequence parallelism, dtype and, for fused weights, stride).
        rank, alpha, dropout: --lora-rank, --lora-alpha, --lora-dropout.
    """

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear | ReplicatedLinear, *, rank: int, alpha: float,
                 dropout: float):
        super().__init__()
        self.enabled = True  # False: the base linear alone (peft.apply.adapters_disabled)
        self.scaling = alpha / rank
        self.dropout = dropout
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.replicated = isinstance(base, ReplicatedLinear)
        if self.replicated:
            self.sequence_parallel = base.weight.sequence_parallel
            replicated = dict(bias=False, sequence_parallel=self.sequence_parallel, params_dtype=base.weight.dtype)
            self.lora_A = ReplicatedLinear(base.in_features, rank, **replicated)
            self.lora_B = ReplicatedLinear(rank, base.out_features, **replicated)
        else:
            self._split_like(base, rank)
        self.lora_A.weight.full_init = kaiming_uniform
        self.lora_B.weight.full_init = zeros

    def _split_like(self, base: ColumnParallelLinear | RowParallelLinear, rank: int) -> None:
        """The factors of a split base: the r-wide activation between them is what crosses ranks."""
        self.sequence_parallel = base.sequence_parallel
        dtype = base.weight.dtype
        tp_config = TensorParallelConfig(tp_group=base.tp_group, sequence_parallel=base.sequence_parallel,
                                         params_dtype=dtype)
        if self.row_parallel:
            self.lora_A = RowParallelLinear(base.input_size, rank, bias=False,
                                            input_is_parallel=base.input_is_parallel, tp_config=tp_config)
            self.lora_B = ReplicatedLinear(rank, base.output_size, bias=False,
                                           sequence_parallel=base.sequence_parallel, params_dtype=dtype)
        else:
            self.lora_A = ReplicatedLinear(base.input_size, rank, bias=False,
                                           sequence_parallel=base.sequence_parallel, params_dtype=dtype)
            # A fused [gate; up] weight is split with stride 2; B's rows must be split the same way.
            self.lora_B = ColumnParallelLinear(rank, base.output_size, bias=False,
                                               partition_stride=base.weight.partition_stride, tp_config=tp_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The scaling multiplies the rank-wide activation between A and B, not the layer-wide output.
        x = self._dropout(x)
        if self.replicated:
            return self.lora_B(self.lora_A(x) * self.scaling)
        if self.row_parallel:
            hidden, _ = self.lora_A(x)
            return self.lora_B(hidden * self.scaling)
        output, _ = self.lora_B(self.lora_A(x) * self.scaling)
        return output

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return x
        # A row-parallel input holds this rank's features, a sequence-parallel one its tokens: own masks.
        # Otherwise every tensor-parallel rank holds the same input and must drop the same elements.
        forked = self.row_parallel or self.sequence_parallel
        with get_rng_tracker().fork() if forked else contextlib.nullcontext():
            return F.dropout(x, p=self.dropout)


class ExpertLoRA(nn.Module):
    """The LoRA of one expert's linear (``ExpertLinear``): its own A and B, split over the expert-tensor ranks as
    the expert's weight is, which needs no communication of its own (the dispatcher's gathers and reductions act
    on its output as on the expert's):

        fc1 (output rows split):  A whole on each rank, B split by rows (stride 2 for SwiGLU's [gate; up])
        fc2 (input columns split): A split by columns, B whole; each rank's B A_r x_r is a partial sum, as its
                                   x_r W_r^T is, and the dispatcher sums both

    The whole factor's gradient is then partial on each expert-tensor rank (``ExpertLinear`` marks it)."""

    def __init__(self, base, *, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.enabled = True  # False: the expert's linear alone (peft.apply.adapters_disabled)
        self.scaling, self.dropout = alpha / rank, dropout
        self.row_parallel = base.partition_dim == 1
        factor = dict(etp_size=base.etp_size, params_dtype=base.weight.dtype)
        self.lora_A = ExpertLinear(base.input_size, rank, partition_dim=1 if self.row_parallel else None, **factor)
        self.lora_B = ExpertLinear(rank, base.output_size, partition_dim=None if self.row_parallel else 0,
                                   partition_stride=base.partition_stride, **factor)
        self.lora_A.weight.full_init = kaiming_uniform
        self.lora_B.weight.full_init = zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            with get_rng_tracker().fork():  # an expert's tokens, and a row-parallel input's features, are its own
                x = F.dropout(x, p=self.dropout)
        return self.lora_B(self.lora_A(x) * self.scaling)


def add_lora_output(module: nn.Module, args: tuple, output):
    """Forward hook of an adapted linear: its (output, bias) (a replicated or expert linear's output alone) with the
    LoRA branch added to the output, in place where the output is a tensor-parallel linear's (its matmul keeps its
    input, not its output, for backward); the output alone while the LoRA is switched off (``enabled``)."""
    if not module.lora.enabled:
        return output
    if not isinstance(output, tuple):
        return output + module.lora(args[0])
    result, bias = output
    return result.add_(module.lora(args[0])), bias


def factor_names(module: str) -> tuple[str, str]:
    """The names of A and B of the LoRA on ``module`` (``decoder.layers.0.mlp.linear_fc1``)."""
    return f"{module}.lora.lora_A.weight", f"{module}.lora.lora_B.weight"


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + (alpha / r) B A on whole (unsplit) tensors, computed in fp32 and returned in W's dtype."""
    return (weight.float() + scaling * lora_b.float() @ lora_a.float()).to(weight.dtype)
