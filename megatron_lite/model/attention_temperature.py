"""Llama 4's temperature tuning of its NoPE layers (``--attn-temperature-tuning``): each query is multiplied by
1 + scale * ln(1 + floor((p + 1) / floor_scale)) at position p, so that attention without position information
stays sharp far into a long context (the layers with rotary embeddings attend within chunks instead:
``chunked_attention.py``). The factor is 1 until position floor_scale - 1 (8192 in Llama 4).

Positions are the model's ``position_ids``, 0 at each sequence's first token, as Meta's reference model counts
them. transformers' Llama 4 counts them from the first column of the batch row, a left-padded prompt's padding
and a packed row's earlier examples included: the same on every unpadded, unpacked sequence.
"""
import torch

from megatron_lite.config import ModelConfig


class AttentionTemperature:
    def __init__(self, floor_scale: int, scale: float):
        self.floor_scale, self.scale = floor_scale, scale

    def __call__(self, query: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Queries [s, b, heads, d] at ``position_ids`` [b, s], scaled (in float32, as transformers)."""
        steps = torch.floor((position_ids.t().float() + 1.0) / self.floor_scale)  # [s, b]
        temperature = torch.log1p(steps) * self.scale + 1.0
        return (query * temperature[..., None, None]).to(query.dtype)


def layer_temperature(config: ModelConfig, layer_number: int) -> AttentionTemperature | None:
    """The temperature of layer ``layer_number`` (global, 0-based), or None where it has none."""
    if not (config.attn_temperature_tuning and config.is_nope_layer(layer_number)):
        return None
    return AttentionTemperature(config.attn_temperature_floor_scale, config.attn_temperature_scale)
