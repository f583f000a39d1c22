"""Which module each part of a transformer layer is (Megatron-Core's layer specs, reduced to classes).

A variant of attention or of the MLP is a class behind its part's interface; the spec picks the class
from the model's config, so ``TransformerLayer`` builds whatever it is handed and tests no flag itself.

    self_attention  SelfAttention (grouped-query, attention.py), or MultiLatentAttention
                    (--multi-latent-attention, multi_latent_attention.py)
    mlp             MLP (mlp.py)
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention import SelfAttention
from megatron_lite.model.mlp import MLP
from megatron_lite.model.multi_latent_attention import MultiLatentAttention


@dataclass(frozen=True)
class TransformerLayerSpec:
    self_attention: type
    mlp: type


def transformer_layer_spec(config: ModelConfig, layer_number: int) -> TransformerLayerSpec:
    """The modules of layer ``layer_number`` (global, 0-based; layers may differ, as DeepSeek's first dense ones
    from its mixture-of-experts ones)."""
    attention = MultiLatentAttention if config.multi_latent_attention else SelfAttention
    return TransformerLayerSpec(self_attention=attention, mlp=MLP)
