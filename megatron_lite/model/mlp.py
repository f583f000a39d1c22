"""The feed-forward block: column-parallel up-projection, GELU, SwiGLU or GeGLU, row-parallel down."""
import torch
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import ModelConfig
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelConfig


class MLP(nn.Module):
    """SwiGLU's gate and up projections share one column-parallel weight laid out as
    ``[gate; up]`` and sharded with stride 2, so each rank holds matching halves. GeGLU (``--geglu``,
    Gemma) is the same gated unit with a tanh-GELU gate."""

    def __init__(self, config: ModelConfig, *, tp_config: TensorParallelConfig):
        super().__init__()
        self.swiglu = config.swiglu
        self.gated_activation = _geglu if config.geglu else kernels.swiglu
        fc1_size = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_size, tp_config=tp_config, bias=config.add_bias_linear,
            partition_stride=2 if config.swiglu else 1, skip_bias_add=True)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_config=tp_config, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        if self.swiglu:
            intermediate = self.gated_activation(intermediate if bias is None else intermediate + bias)
        else:
            intermediate = kernels.bias_gelu(intermediate, bias)
        return self.linear_fc2(intermediate)


def _geglu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` where the last dim of ``x`` is [gate, up]."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return kernels.bias_gelu(gate, None) * up
