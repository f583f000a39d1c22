"""The feed-forward block: column-parallel up-projection, GELU, SwiGLU, GeGLU or quick GeGLU, row-parallel down."""
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import ModelConfig
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelConfig


class MLP(nn.Module):
    """SwiGLU's gate and up projections share one column-parallel weight laid out as
    ``[gate; up]`` and sharded with stride 2, so each rank holds matching halves. GeGLU (``--geglu``,
    Gemma) is the same gated unit with a tanh-GELU gate. ``ffn_hidden_size`` overrides the config's
    (a mixture-of-experts layer's shared expert has its own width)."""

    def __init__(self, config: ModelConfig, *, tp_config: TensorParallelConfig, ffn_hidden_size: Optional[int] = None):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.activation = mlp_activation(config)
        fc1_size = 2 * ffn_hidden_size if config.swiglu else ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_size, tp_config=tp_config, bias=config.add_bias_linear,
            partition_stride=2 if config.swiglu else 1, skip_bias_add=True)
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size, config.hidden_size, tp_config=tp_config, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        return self.linear_fc2(self.activation(intermediate, bias))


def mlp_activation(config: ModelConfig) -> Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]:
    """``activation(fc1 output, fc1 bias or None)``: SwiGLU, GeGLU or quick GeGLU on ``[gate, up]``, else GELU (the
    experts of a mixture-of-experts layer use it too); the GELU is the tanh approximation (the fused kernel's) or,
    with --gelu-exact, the erf one (PyTorch's own kernel: there is no tanh to fuse away). gpt-oss's gated unit
    (--quick-geglu, --glu-linear-offset, --activation-func-clamp-value) is ``_clamped_glu``."""
    gelu = _bias_gelu_exact if config.gelu_exact else kernels.bias_gelu
    if not config.swiglu:
        return gelu
    if config.quick_geglu or config.glu_linear_offset or config.activation_func_clamp_value is not None:
        gate = _quick_gelu if config.quick_geglu else F.silu
        gated = functools.partial(_clamped_glu, gate, config.glu_linear_offset, config.activation_func_clamp_value)
    else:
        gated = functools.partial(_geglu, gelu) if config.geglu else kernels.swiglu

    def gated_activation(intermediate: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return gated(intermediate if bias is None else intermediate + bias)
    return gated_activation


def _bias_gelu_exact(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.gelu(x if bias is None else x + bias)


def _geglu(gelu, x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` where the last dim of ``x`` is [gate, up]."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return gelu(gate, None) * up


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x sigmoid(1.702 x), GELU's sigmoid approximation (Megatron-Core's quick_gelu; gpt-oss's swiglu_alpha)."""
    return x * torch.sigmoid(1.702 * x)


def _clamped_glu(gate_function, offset: float, clamp: Optional[float], x: torch.Tensor) -> torch.Tensor:
    """``gate_function(gate) * (up + offset)`` where the last dim of ``x`` is [gate, up], with the gate clamped to
    at most ``clamp`` and up to [-clamp, clamp] first (gpt-oss: quick GELU, offset 1, clamp 7), which bounds what
    one expert can add to the residual however large its inputs grow."""
    gate, up = torch.chunk(x, 2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    return gate_function(gate) * (up + offset)
