"""RoPE frequency scaling, which stretches a model's context: each variant maps the inverse
frequencies base^(-2i/d) to new ones (see docs/reference.md section 12, "Rotary embeddings and their scaling").

- linear (``--rotary-seq-len-interpolation-factor f``): every frequency / f, i.e. positions / f.
- Llama 3.x (``--use-rope-scaling``, factor f): wavelengths 2 pi / freq shorter than the original
  context / 4 keep their frequency, those longer than the original context are divided by f, and
  between the two it is blended linearly in (original context / wavelength). As Megatron-LM, the
  original context is 8192 and the low/high frequency factors are 1 and 4 (Llama 3.1 and 3.2's values).
"""
import math

import torch

from megatron_lite.config import ModelConfig

LLAMA3_ORIGINAL_CONTEXT = 8192
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0


def scaled_inverse_frequencies(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``inv_freq`` under the model's RoPE scaling (unchanged without one)."""
    if config.rotary_seq_len_interpolation_factor is not None:
        return inv_freq / config.rotary_seq_len_interpolation_factor
    if config.use_rope_scaling:
        return _llama3(inv_freq, config.rope_scaling_factor)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength exceeds the original context (fully scaled), 1 where it is under context / 4.
    smooth = ((LLAMA3_ORIGINAL_CONTEXT / wavelength - LLAMA3_LOW_FREQ_FACTOR)
              / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq
