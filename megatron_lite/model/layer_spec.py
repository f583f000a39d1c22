"""Which module each part of a transformer layer is (Megatron-Core's layer specs, reduced to builders).

A variant of attention or of the MLP is a class behind its part's interface; the spec picks the class
from the model's config and the layer's number, so ``TransformerLayer`` builds whatever it is handed and
tests no flag itself.

    self_attention  SelfAttention (grouped-query, attention.py), or MultiLatentAttention
                    (--multi-latent-attention, multi_latent_attention.py), or GatedDeltaNet (linear attention,
                    gated_delta_net.py) where --experimental-attention-variant gdn and --linear-attention-freq put one
    mlp             MLP (dense, mlp.py), or MoELayer (a mixture of experts, moe/moe_layer.py) where
                    --num-experts and --moe-layer-freq put one

Each part is built as ``part(config, tp_config=..., ...)``; what only one variant needs (the experts'
expert-parallel groups) is bound into its builder here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.attention import SelfAttention
from megatron_lite.model.gated_delta_net import GatedDeltaNet
from megatron_lite.model.mlp import MLP
from megatron_lite.model.moe import MoELayer
from megatron_lite.model.multi_latent_attention import MultiLatentAttention


@dataclass(frozen=True)
class TransformerLayerSpec:
    # (config, *, layer_number, tp_config, context_parallel, checkpoint_core_attention)
    self_attention: Callable[..., nn.Module]
    mlp: Callable[..., nn.Module]  # (config, *, tp_config); both MLP kinds take [s, b, h], return (output, bias)


def transformer_layer_spec(config: ModelConfig, layer_number: int, *,
                           ep_config: ExpertParallelConfig = ExpertParallelConfig(),
                           context_parallel: ContextParallelConfig | None = None) -> TransformerLayerSpec:
    """The modules of layer ``layer_number`` (global, 0-based; layers may differ, as DeepSeek's first dense
    MLPs from its mixture-of-experts ones)."""
    attention = MultiLatentAttention if config.multi_latent_attention else SelfAttention
    if config.is_linear_attention_layer(layer_number):
        attention = GatedDeltaNet
    mlp = (functools.partial(MoELayer, ep_config=ep_config, context_parallel=context_parallel)
           if config.is_moe_layer(layer_number) else MLP)
    return TransformerLayerSpec(self_attention=attention, mlp=mlp)
