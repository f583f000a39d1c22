"""A linear layer every tensor-parallel rank holds whole (Transformer Engine's "duplicated" mode).

Some weights are too small to be worth splitting: PEFT's added weights, tiny next to the layers
they adapt, and multi-latent attention's down-projections into its low-rank latents. They are
replicated over the tensor-parallel ranks instead: each rank computes the same product and
nothing is communicated for them. Their gradients are then identical on every rank, except
under sequence parallelism, where each rank sees only its slice of the sequence and the gradient
is a partial sum: ``sequence_parallel`` marks them for ``finalize_model_grads`` to sum over the
tensor-parallel group, exactly as for the norm weights.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_lite.tensor_parallel.layers import set_tensor_model_parallel_attributes


class ReplicatedLinear(nn.Linear):
    """``nn.Linear`` marked as replicated over tensor-parallel ranks (for init, checkpoints and the grad norm).

    Args:
        sequence_parallel: its input is this rank's slice of the sequence, so its gradients are partial.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool, sequence_parallel: bool,
                 params_dtype: torch.dtype):
        super().__init__(input_size, output_size, bias=bias, dtype=params_dtype)
        for param in self.parameters():
            set_tensor_model_parallel_attributes(param, is_parallel=False)
            param.sequence_parallel = sequence_parallel
