"""Bottleneck adapters (Houlsby et al. 2019): h + U f(D h) after attention and after the MLP.

D (m x h) projects the sublayer's output down to ``--adapter-dim`` m, GELU, U (h x m)
projects back up; U starts at zero so the adapted model starts as the base model.
The adapter sits on the sublayer's output before the residual connection adds it.

Under tensor parallelism the sublayer's output is whole on every rank (after the
row-parallel all-reduce), so both projections are replicated: at m much smaller
than h the repeated work is cheaper than any communication, and the gradients
are already identical on every rank (partial over the sequence under sequence
parallelism, summed by ``finalize_model_grads``; see ``tensor_parallel/replicated_linear.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.peft.lora import zeros
from megatron_lite.tensor_parallel.replicated_linear import ReplicatedLinear


class BottleneckAdapter(nn.Module):
    def __init__(self, hidden_size: int, adapter_dim: int, *, sequence_parallel: bool, params_dtype: torch.dtype):
        super().__init__()
        linear = dict(bias=True, sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.linear_in = ReplicatedLinear(hidden_size, adapter_dim, **linear)
        self.linear_out = ReplicatedLinear(adapter_dim, hidden_size, **linear)
        self.linear_out.weight.full_init = zeros

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.linear_out(F.gelu(self.linear_in(hidden_states)))


def apply_adapter(module: nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook of an attention or MLP block: its (output, bias) through the block's adapter.

    The bias is added first (the adapter sees the sublayer's whole output); what the layer
    then adds to the residual stream is the adapted output, with no bias left to add."""
    result, bias = output
    if bias is not None:
        result = result + bias
    return module.adapter(result), None
