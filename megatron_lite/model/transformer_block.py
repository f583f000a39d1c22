"""The stack of transformer layers one pipeline chunk holds, with activation recomputation."""
import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.embedding import RotaryAngles
from megatron_lite.model.transformer_layer import TransformerLayer
from megatron_lite.tensor_parallel import TensorParallelConfig
from megatron_lite.tensor_parallel.random import checkpoint


class TransformerBlock(nn.Module):
    """Layers are keyed by their global number, so a checkpoint written by one pipeline
    layout names the same weights as any other.

    ``recompute_granularity='full'`` keeps only the inputs of recomputed layers:
    ``uniform`` checkpoints groups of ``recompute_num_layers`` layers, ``block``
    checkpoints the first ``recompute_num_layers`` layers of this chunk one by one.
    ``selective`` recomputes only the attention core (the s^2 part of the activations).

    Each layer is handed the rotary angles of its kind (``RotaryAngles``: local layers may have their own), and a
    NoPE layer (--no-rope-freq) none: it attends without position information.
    """

    def __init__(self, config: ModelConfig, layer_numbers: range, *, tp_config: TensorParallelConfig,
                 context_parallel: ContextParallelConfig | None = None,
                 ep_config: ExpertParallelConfig = ExpertParallelConfig(), recompute_granularity: str | None = None,
                 recompute_method: str | None = None, recompute_num_layers: int | None = None):
        super().__init__()
        self.layers = nn.ModuleDict({
            str(n): TransformerLayer(config, layer_number=n, tp_config=tp_config, context_parallel=context_parallel,
                                     ep_config=ep_config,
                                     checkpoint_core_attention=recompute_granularity == "selective")
            for n in layer_numbers})
        self.recompute_full = recompute_granularity == "full"
        self.recompute_method = recompute_method or "uniform"
        self.recompute_num_layers = recompute_num_layers or 1

    def forward(self, hidden_states: torch.Tensor, rotary: RotaryAngles | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inference_context=None, positions_are_columns: bool = False) -> torch.Tensor:
        layers, columns = list(self.layers.values()), positions_are_columns
        if not (self.recompute_full and self.training):
            for layer in layers:
                hidden_states = layer(hidden_states, layer_angles(rotary, layer), attention_mask, position_ids,
                                      inference_context, columns)
            return hidden_states
        if self.recompute_method == "uniform":
            for start in range(0, len(layers), self.recompute_num_layers):
                group = layers[start:start + self.recompute_num_layers]
                hidden_states = checkpoint(_run_layers(group, columns), hidden_states, rotary, attention_mask,
                                           position_ids)
            return hidden_states
        for index, layer in enumerate(layers):  # "block"
            if index < self.recompute_num_layers:
                hidden_states = checkpoint(layer, hidden_states, layer_angles(rotary, layer), attention_mask,
                                           position_ids, None, columns)
            else:
                hidden_states = layer(hidden_states, layer_angles(rotary, layer), attention_mask, position_ids,
                                      None, columns)
        return hidden_states


def layer_angles(rotary: RotaryAngles | None, layer: TransformerLayer) -> torch.Tensor | None:
    """The rotary angles ``layer`` attends with: its kind's (local or global), none for a NoPE layer."""
    return None if rotary is None or layer.nope else rotary.of_layer(layer.local_attention)


def _run_layers(layers, positions_are_columns: bool):
    def run(hidden_states, rotary, attention_mask, position_ids):
        for layer in layers:
            hidden_states = layer(hidden_states, layer_angles(rotary, layer), attention_mask, position_ids, None,
                                  positions_are_columns)
        return hidden_states
    return run
