"""Pre-norm LayerNorm (GPT-2) or RMSNorm (Llama), through the fused-kernel dispatch.

With ``--apply-layernorm-1p`` the stored weight is the scale minus one (zero at init), Megatron-LM's
zero-centred gamma: a 16-bit weight near 0 resolves far finer changes than one near 1.
"""
import torch
from torch import nn

from megatron_lite import kernels


class Norm(nn.Module):
    """Normalises the last dimension. Its parameters are replicated over tensor-parallel ranks;
    under sequence parallelism each rank sees different tokens, so their gradients are partial
    sums that ``finalize_model_grads`` all-reduces (hence the ``sequence_parallel`` mark)."""

    def __init__(self, hidden_size: int, *, normalization: str, eps: float, sequence_parallel: bool,
                 params_dtype: torch.dtype, apply_layernorm_1p: bool = False):
        super().__init__()
        self.normalization = normalization
        self.eps = eps
        self.apply_layernorm_1p = apply_layernorm_1p
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype))
        self.bias = (nn.Parameter(torch.empty(hidden_size, dtype=params_dtype))
                     if normalization == "LayerNorm" else None)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernels scale in float32; adding the 1 there too keeps small (scale - 1) exact under bf16.
        weight = self.weight.float() + 1.0 if self.apply_layernorm_1p else self.weight
        if self.normalization == "RMSNorm":
            return kernels.rms_norm(x, weight, self.eps)
        return kernels.layer_norm(x, weight, self.bias, self.eps)
