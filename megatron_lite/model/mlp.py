"""The feed-forward block: column-parallel up-projection, GELU or SwiGLU, row-parallel down."""
import torch
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import ModelConfig
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """SwiGLU's gate and up projections share one column-parallel weight laid out as
    ``[gate; up]`` and sharded with stride 2, so each rank holds matching halves."""

    def __init__(self, config: ModelConfig, *, tp_group, sequence_parallel: bool, params_dtype: torch.dtype):
        super().__init__()
        self.swiglu = config.swiglu
        fc1_size = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_size, tp_group=tp_group, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, partition_stride=2 if config.swiglu else 1,
            skip_bias_add=True, params_dtype=params_dtype)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear,
            input_is_parallel=True, sequence_parallel=sequence_parallel, skip_bias_add=True,
            params_dtype=params_dtype)

    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        if self.swiglu:
            intermediate = kernels.swiglu(intermediate if bias is None else intermediate + bias)
        else:
            intermediate = kernels.bias_gelu(intermediate, bias)
        return self.linear_fc2(intermediate)
