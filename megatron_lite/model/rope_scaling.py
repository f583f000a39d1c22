"""RoPE frequency scaling, which stretches a model's context: each variant maps the inverse
frequencies base^(-2i/d) to new ones (see docs/reference.md section 12, "Rotary embeddings and their scaling").

- linear (``--rotary-seq-len-interpolation-factor f``): every frequency / f, i.e. positions / f.
- Llama 3.x (``--use-rope-scaling``, factor f): wavelengths 2 pi / freq shorter than the original
  context / high keep their frequency, those longer than the original context / low are divided by f, and
  between the two it is blended linearly in (original context / wavelength). As Megatron-LM, the
  original context is 8192 and the low/high frequency factors are 1 and 4 unless given
  (``--rope-scaling-low-freq-factor``, ``--rope-scaling-high-freq-factor``): Llama 3.1 and 3.2's values; Llama
  4 Scout's are 1 and 1, a step at the original context (the blend's division by zero gives +-inf, clamped to
  the two sides, as transformers' formula does).
- YaRN (``--position-embedding-type yarn``, multi-latent attention's ``--rope-type yarn``; factor f =
  ``--rotary-scaling-factor``): channel pairs that turn more than beta_fast times over the original
  context keep their frequency, those turning fewer than beta_slow times are divided by f, and between
  the two the blend is linear in the channel index (the "correction range", rounded out to whole
  channels unless --no-yarn-correction-range-round-to-int). The rotated channels are then scaled by the
  concentration mscale(f, --mscale) / mscale(f, --mscale-all-dim), mscale(f, m) = 0.1 m ln f + 1, which
  sharpens the softmax of the longer context; multi-latent attention also multiplies its softmax scale by
  mscale(f, --mscale-all-dim)^2 (``mla_softmax_scale``).
"""
import math

import torch

from megatron_lite.config import ModelConfig

LLAMA3_ORIGINAL_CONTEXT = 8192


def scaled_inverse_frequencies(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``inv_freq`` under the model's RoPE scaling (unchanged without one)."""
    if config.rotary_seq_len_interpolation_factor is not None:
        return inv_freq / config.rotary_seq_len_interpolation_factor
    if config.use_rope_scaling:
        return _llama3(inv_freq, config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                       config.rope_scaling_high_freq_factor)
    if config.yarn:
        return _yarn(inv_freq, config)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, factor: float, low: float, high: float) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength exceeds the original context / low (fully scaled), 1 where it is under context / high.
    smooth = ((LLAMA3_ORIGINAL_CONTEXT / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    pairs = inv_freq.numel()
    low, high = _yarn_correction_range(config, 2 * pairs)
    if low == high:  # one channel: a step, not a ramp
        high += 0.001
    # 0 up to channel pair `low` (fast: kept), 1 from `high` on (slow: divided by the factor).
    ramp = ((torch.arange(pairs, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0.0, 1.0)
    return inv_freq / config.rotary_scaling_factor * ramp + inv_freq * (1 - ramp)


def _yarn_correction_range(config: ModelConfig, dim: int) -> tuple[float, float]:
    """The channel pairs (as fractional indices into the dim / 2 frequencies) between which YaRN blends: pair
    i turns context / (2 pi base^(2i/dim)) times over the original context, so the pair turning r times is
    dim ln(context / (2 pi r)) / (2 ln base)."""
    def pair_turning(turns: float) -> float:
        return (dim * math.log(config.yarn_original_max_position_embeddings / (turns * 2 * math.pi))
                / (2 * math.log(config.rotary_base)))

    low, high = pair_turning(config.yarn_beta_fast), pair_turning(config.yarn_beta_slow)
    if config.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_concentration(config: ModelConfig) -> float:
    """What the rotated channels of queries and keys are multiplied by: YaRN's concentration, else 1."""
    if not config.yarn:
        return 1.0
    return _mscale(config.rotary_scaling_factor, config.mscale) / _mscale(config.rotary_scaling_factor,
                                                                         config.mscale_all_dim)


def mla_softmax_scale(config: ModelConfig) -> float:
    """Multi-latent attention's softmax scale: 1/sqrt(query head width) (or --softmax-scale), times
    mscale(f, --mscale-all-dim)^2 under YaRN, as DeepSeek-V2/V3 and Megatron-LM's MLA compute it."""
    head_width = config.qk_head_dim + config.qk_pos_emb_head_dim
    scale = config.softmax_scale or 1.0 / math.sqrt(head_width)
    if not config.yarn:
        return scale
    return scale * _mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2
