"""The experts a rank holds: one MLP each, run on the rows the dispatcher grouped by expert.

Each expert is named by its global number (``local_experts.<e>``), as layers are, so a checkpoint names
the same weights whichever expert-parallel layout wrote it: expert parallelism needs no split in the
checkpoint format, a rank simply holds (and loads) the experts it runs. Each expert's weights are
split over the expert-tensor-parallel ranks as a dense MLP's are over the tensor-parallel ones (fc1
by output rows, stride 2 for SwiGLU's [gate; up]; fc2 by input columns; ``expert_parallel/layers.py``'s
``ExpertLinear``) and marked ``expert_parallel``: ``ParallelState.tensor_split`` then says which group
splits them.

The experts communicate nothing themselves: the dispatcher gathers their input over the
expert-tensor ranks and reduce-scatters their partial outputs.

    SequentialExperts   a loop over the experts, one block of rows each: the reference
    GroupedExperts      the same weights, stacked and multiplied in one torch._grouped_mm per
                        projection (--moe-grouped-gemm); tested against the loop
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.expert_parallel import ExpertLinear
from megatron_lite.model.mlp import mlp_activation


class ExpertMLP(nn.Module):
    """One expert; ``etp_rank`` its expert-tensor rank, on which 0 alone adds fc2's bias (``ExpertLinear``)."""

    def __init__(self, config: ModelConfig, *, etp_size: int, params_dtype: torch.dtype, etp_rank: int = 0):
        super().__init__()
        ffn = config.moe_ffn_hidden_size
        self.activation = mlp_activation(config)
        self.linear_fc1 = ExpertLinear(config.hidden_size, 2 * ffn if config.swiglu else ffn, partition_dim=0,
                                       partition_stride=2 if config.swiglu else 1, etp_size=etp_size,
                                       params_dtype=params_dtype, bias=config.add_bias_linear)
        self.linear_fc2 = ExpertLinear(ffn, config.hidden_size, partition_dim=1, etp_size=etp_size,
                                       params_dtype=params_dtype, bias=config.add_bias_linear,
                                       adds_bias=etp_rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x), None))


class SequentialExperts(nn.Module):
    """Experts ``first_expert`` .. ``first_expert + num_local_experts - 1`` of the layer."""

    def __init__(self, config: ModelConfig, *, first_expert: int, num_local_experts: int, etp_size: int,
                 params_dtype: torch.dtype, etp_rank: int = 0):
        super().__init__()
        self.local_experts = nn.ModuleDict({
            str(first_expert + i): ExpertMLP(config, etp_size=etp_size, etp_rank=etp_rank, params_dtype=params_dtype)
            for i in range(num_local_experts)})

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """rows [sum(tokens_per_expert), h], expert by expert -> each row through its expert.
        Every expert runs, on no rows if it got none, so each weight has a gradient every micro-batch."""
        blocks = rows.split(tokens_per_expert)
        return torch.cat([expert(block) for expert, block in zip(self.local_experts.values(), blocks)])


class GroupedExperts(SequentialExperts):
    """The same experts and weights, each projection one grouped GEMM over all of them. torch._grouped_mm
    takes the weights as one [experts, in, out] tensor, stacked here from the experts' own (a copy each
    forward, which keeps one parameter per expert: the checkpoint and the loop see the same names)."""

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(config, **kwargs)
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm for grouped expert GEMMs.")
        self.activation = mlp_activation(config)

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        experts = list(self.local_experts.values())
        offsets = torch.tensor(tokens_per_expert, device=rows.device).cumsum(0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2)
        fc2 = torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2)
        intermediate = self.activation(torch._grouped_mm(rows, fc1, offs=offsets),
                                       _row_biases([e.linear_fc1 for e in experts], tokens_per_expert))
        output = torch._grouped_mm(intermediate, fc2, offs=offsets)
        biases = _row_biases([e.linear_fc2 for e in experts], tokens_per_expert)
        return output if biases is None else output + biases


def _row_biases(linears: list, tokens_per_expert: list[int]):
    """Each row's bias of its expert's ``linears`` [rows, out], or None where they add none."""
    if linears[0].bias is None or not linears[0].adds_bias:
        return None
    counts = torch.tensor(tokens_per_expert, device=linears[0].bias.device)
    return torch.stack([linear.bias for linear in linears]).repeat_interleave(counts, dim=0)
