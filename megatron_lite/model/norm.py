"""Pre-norm LayerNorm (GPT-2) or RMSNorm (Llama), through the fused-kernel dispatch; OLMoE's RMSNorm of a whole
query or key projection, over tensor-parallel ranks; Llama 4's weightless L2 norm of queries and keys.

With ``--apply-layernorm-1p`` the stored weight is the scale minus one (zero at init), Megatron-LM's
zero-centred gamma: a 16-bit weight near 0 resolves far finer changes than one near 1.
"""
import torch
from torch import nn

from megatron_lite import kernels
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import set_tensor_model_parallel_attributes
from megatron_lite.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)


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


class ProjectionRMSNorm(nn.Module):
    """RMSNorm of a token's whole query (or key) projection, all heads together, with a weight per channel
    (OLMoE's q/k norms, ``--qk-layernorm-whole-projection``): [s, b, heads, d] in and out.

    Tensor-parallel ranks hold different heads, so the mean square is over every rank's channels: each
    rank's sum of squares is all-reduced over ``tp_group``, and in backward so is its gradient (every
    rank's output depends on every rank's channels). The weight is split with the heads, like the rows
    of the column-parallel projection it follows, and its gradient on each rank is whole.
    """

    def __init__(self, width: int, *, eps: float, tp_group, params_dtype: torch.dtype):
        super().__init__()
        tp_size = collectives.world_size(tp_group)
        if width % tp_size:
            raise ValueError(f"a q/k norm {width} wide does not split over {tp_size} tensor-parallel ranks.")
        self.width, self.eps = width, eps
        self.tp_group = tp_group if tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(width // tp_size, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, partition_dim=0, partition_stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2).float()
        square_sum = flat.square().sum(dim=-1, keepdim=True)
        if self.tp_group is not None:  # all-reduced forward (reduce_from) and backward (copy_to)
            square_sum = copy_to_tensor_model_parallel_region(
                reduce_from_tensor_model_parallel_region(square_sum, self.tp_group), self.tp_group)
        normed = flat * torch.rsqrt(square_sum / self.width + self.eps)
        return (self.weight * normed.to(x.dtype)).view_as(x)


class L2Norm(nn.Module):
    """Each vector divided by its root mean square, without a weight (Megatron-Core's L2Norm, --qk-l2-norm; Llama
    4's q/k norm), in float32."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
