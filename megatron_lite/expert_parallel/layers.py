"""The linear layer of one expert: its weight split over the expert-tensor-parallel ranks (or whole on each).

It communicates nothing itself: the token dispatcher gathers its input rows over the expert-tensor ranks
and reduce-scatters the partial outputs of a weight split by input columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.tensor_parallel import set_tensor_model_parallel_attributes


class ExpertLinear(nn.Module):
    """y = x W^T for one expert's shard of W ([out, in], split along ``partition_dim`` over ``etp_size``), or, with
    ``partition_dim`` None, the whole W on every expert-tensor rank (a LoRA factor of an expert, ``peft/lora.py``,
    whose gradient is then partial on each: it is marked to be summed over the tensor ranks, which are the
    expert-tensor ones where LoRA adapts split experts).

    ``bias`` (gpt-oss's experts): + b, split with W's output rows (``partition_dim`` 0); a weight split by input
    columns gives partial outputs that the dispatcher sums over the expert-tensor ranks, so its whole bias joins
    on expert-tensor rank 0 alone (``adds_bias``), and its gradient, there alone, is summed over the tensor ranks
    (which are the expert-tensor ones where biased experts are split, ``config``'s check)."""

    def __init__(self, input_size: int, output_size: int, *, partition_dim: int | None, partition_stride: int = 1,
                 etp_size: int, params_dtype: torch.dtype, bias: bool = False, adds_bias: bool = True):
        super().__init__()
        self.input_size, self.output_size, self.etp_size = input_size, output_size, etp_size
        self.partition_dim, self.partition_stride = partition_dim, partition_stride
        shape = [output_size, input_size]
        if partition_dim is not None:
            if shape[partition_dim] % etp_size:
                raise ValueError(f"an expert's dimension {partition_dim} ({shape[partition_dim]}) does not split "
                                 f"evenly over {etp_size} expert-tensor-parallel ranks.")
            shape[partition_dim] //= etp_size
        self.weight = nn.Parameter(torch.empty(*shape, dtype=params_dtype))
        if partition_dim is not None:
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, partition_dim=partition_dim,
                                                 partition_stride=partition_stride)
        else:
            self.weight.sequence_parallel = etp_size > 1
        self.weight.expert_parallel = True
        self.bias, self.adds_bias = None, adds_bias
        if bias:
            split = partition_dim == 0
            self.bias = nn.Parameter(torch.empty(shape[0], dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=split, partition_dim=0,
                                                 partition_stride=partition_stride)
            self.bias.sequence_parallel = not split and etp_size > 1
            self.bias.expert_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.adds_bias else None)
