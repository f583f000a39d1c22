"""Pre-norm LayerNorm (GPT-2) or RMSNorm (Llama), through the fused-kernel dispatch."""
import torch
from torch import nn

from megatron_lite import kernels


class Norm(nn.Module):
    """Normalises the last dimension. Its parameters are replicated over tensor-parallel ranks;
    under sequence parallelism each rank sees different tokens, so their gradients are partial
    sums that ``finalize_model_grads`` all-reduces (hence the ``sequence_parallel`` mark)."""

    def __init__(self, hidden_size: int, *, normalization: str, eps: float, sequence_parallel: bool,
                 params_dtype: torch.dtype):
        super().__init__()
        self.normalization = normalization
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype))
        self.bias = (nn.Parameter(torch.empty(hidden_size, dtype=params_dtype))
                     if normalization == "LayerNorm" else None)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)
