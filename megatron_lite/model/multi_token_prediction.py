"""Multi-token prediction (DeepSeek-V3; Megatron-LM's --mtp-num-layers D, --mtp-loss-scaling-factor λ).

D more layers after the decoder, on the last pipeline stage (which holds the output layer they share, and a
copy of the word embedding they share: ``GPTModel``). Depth k = 1..D sees each position i with the token
k positions on, as Megatron-Core's MultiTokenPredictionLayer:

    t^k, p^k   = t^{k-1}, p^{k-1} rolled left by one (the last position takes token 0, position 0)
    h^k        = final_layernorm_k(Layer_k(eh_proj_k([enorm_k(Emb(t^k, p^k)); hnorm_k(h^{k-1})])))
    logits^k   = OutputLayer(h^k)

with h^0 the decoder's output after its final norm, Layer_k a transformer layer of the decoder's last layer's
kind (its experts too) attending with the decoder's mask and rotary angles, and [a; b] the concatenation along
the hidden dimension (eh_proj is column-parallel, its output gathered, then scattered again under sequence
parallelism). Depth k's labels and loss mask are depth k - 1's rolled left by one (label[i] = token i + k + 1),
a position whose token k on lies in another document (packed sequences: its position id is not p_i + k) or
past the sequence masked out. Each micro-batch's

    L_k      = sum_i mask^k_i CE(logits^k_i, label^k_i) / sum_i mask^k_i
    L_mtp    = λ / D * sum_k L_k

joins the language-model loss through the gradient alone (``attach_loss``, Megatron-Core's
MTPLossAutoScaler: the loss the trainer reports is the language model's), scaled as that loss's gradient is
(``AuxLossScale``: with a per-token loss L_mtp counts the micro-batch's language-model tokens, as Megatron's
original_num_tokens). Each L_k is logged as ``mtp_k loss``: Megatron-LM's mean over the micro-batches and
data-parallel replicas of the step, then over the iterations of the log interval (docs/reference.md section 18).

The layers are trained and checkpointed, and used for nothing else: generation runs the decoder alone.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.embedding import RotaryAngles
from megatron_lite.model.moe.aux_losses import attach_loss
from megatron_lite.model.moe.router import AuxLossScale
from megatron_lite.model.norm import Norm
from megatron_lite.model.transformer_block import layer_angles
from megatron_lite.model.transformer_layer import TransformerLayer
from megatron_lite.tensor_parallel import (ColumnParallelLinear, TensorParallelConfig,
                                           gather_from_tensor_model_parallel_region,
                                           scatter_to_sequence_parallel_region)


def roll_left(tensor: torch.Tensor) -> torch.Tensor:
    """[b, s] -> each row shifted one position left, the last position 0 (Megatron-Core's roll_tensor)."""
    return torch.cat([tensor[:, 1:], tensor.new_zeros(tensor.shape[0], 1)], dim=1)


class MultiTokenPredictionLayer(nn.Module):
    """Depth ``depth`` + 1 (Megatron-LM's mtp.layers.{depth}): enorm, hnorm, eh_proj, mtp_model_layer and
    final_layernorm, as Megatron-Core names them."""

    def __init__(self, config: ModelConfig, *, depth: int, tp_config: TensorParallelConfig,
                 context_parallel: ContextParallelConfig | None = None,
                 ep_config: ExpertParallelConfig = ExpertParallelConfig()):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_config.tp_group, tp_config.sequence_parallel
        norm = dict(normalization=config.normalization, eps=config.norm_epsilon,
                    apply_layernorm_1p=config.apply_layernorm_1p, sequence_parallel=tp_config.sequence_parallel,
                    params_dtype=tp_config.params_dtype)
        self.enorm = Norm(config.hidden_size, **norm)
        self.hnorm = Norm(config.hidden_size, **norm)
        self.eh_proj = ColumnParallelLinear(2 * config.hidden_size, config.hidden_size, bias=False,
                                            tp_config=tp_config)
        # Numbered on after the decoder's layers: its own key/value-cache and weight-init names.
        self.mtp_model_layer = TransformerLayer(config, layer_number=config.num_layers + depth, tp_config=tp_config,
                                                context_parallel=context_parallel, ep_config=ep_config)
        self.final_layernorm = Norm(config.hidden_size, **norm)

    def forward(self, hidden_states: torch.Tensor, embeddings: torch.Tensor, rotary: RotaryAngles | None,
                attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                positions_are_columns: bool = False) -> torch.Tensor:
        """The previous depth's [s, b, h] (``hidden_states``) and the embeddings of the tokens one further on ->
        this depth's [s, b, h] (each [s/tp, b, h] under sequence parallelism); ``rotary``, ``attention_mask``,
        ``position_ids`` and ``positions_are_columns`` the decoder's."""
        combined = torch.cat([self.enorm(embeddings), self.hnorm(hidden_states)], dim=-1)
        projected, _ = self.eh_proj(combined)
        projected = gather_from_tensor_model_parallel_region(projected, self.tp_group)
        if self.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected, self.tp_group)
        output = self.mtp_model_layer(projected, layer_angles(rotary, self.mtp_model_layer), attention_mask,
                                      position_ids, None, positions_are_columns)
        return self.final_layernorm(output)


class MultiTokenPredictionBlock(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_config: TensorParallelConfig,
                 context_parallel: ContextParallelConfig | None = None,
                 ep_config: ExpertParallelConfig = ExpertParallelConfig()):
        super().__init__()
        self.scaling_factor = config.mtp_loss_scaling_factor / config.mtp_num_layers
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, depth=depth, tp_config=tp_config, context_parallel=context_parallel,
                                      ep_config=ep_config) for depth in range(config.mtp_num_layers))
        self.loss_scale = AuxLossScale()  # set for each iteration by ``start_iteration``
        self.logged_losses: list[torch.Tensor] = []  # the last micro-batch's L_k, detached

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                embedding, rotary: RotaryAngles | None, attention_mask: torch.Tensor | None,
                positions_are_columns: bool = False) -> list[torch.Tensor]:
        """Every depth's hidden states h^1 .. h^D from the decoder's normalised output h^0; ``embedding`` is
        the model's (``LanguageModelEmbedding``)."""
        outputs, positions = [], position_ids  # the decoder's, which its attention reads as the rotary angles
        for layer in self.layers:
            input_ids, position_ids = roll_left(input_ids), roll_left(position_ids)
            hidden_states = layer(hidden_states, embedding(input_ids, position_ids), rotary, attention_mask,
                                  positions, positions_are_columns)
            outputs.append(hidden_states)
        return outputs

    def attach_loss(self, lm_loss: torch.Tensor, depth_losses, labels: torch.Tensor, loss_mask: torch.Tensor,
                    position_ids: torch.Tensor) -> torch.Tensor:
        """``lm_loss`` [b, s] unchanged, L_mtp's gradient joining its backward; ``depth_losses(k, labels)`` is
        depth k's per-token cross entropy [b, s] against ``labels``. Records each L_k for the log."""
        loss_mask = loss_mask.float()
        num_tokens = loss_mask.sum()
        total, self.logged_losses, positions = 0.0, [], position_ids
        for depth in range(1, len(self.layers) + 1):
            labels, loss_mask, positions = roll_left(labels), roll_left(loss_mask), roll_left(positions)
            # Token i + depth must continue position i's document (packed sequences restart their positions).
            loss_mask = loss_mask * (positions == position_ids + depth)
            count = loss_mask.sum()
            loss = (depth_losses(depth, labels) * loss_mask).sum() / count.clamp(min=1)
            self.logged_losses.append(loss.detach())
            total = total + self.scaling_factor * loss
        return attach_loss(lm_loss, total, self.loss_scale.of(num_tokens.item()))


def mtp_blocks(model_chunks: list) -> list[MultiTokenPredictionBlock]:
    """The multi-token prediction blocks of this rank's chunks (wrapped chunks or bare models)."""
    return [m for chunk in model_chunks for m in getattr(chunk, "module", chunk).modules()
            if isinstance(m, MultiTokenPredictionBlock)]


def start_iteration(model_chunks: list, scale: AuxLossScale) -> None:
    """How this iteration's language-model loss reaches the gradient (``routing_statistics.start_iteration``'s
    too), which L_mtp's follows."""
    for block in mtp_blocks(model_chunks):
        block.loss_scale = scale


def logged_losses(model) -> dict:
    """The last micro-batch's ``mtp_k loss`` entries for ``loop.loss_func``'s dict, [L_k, 1] each, so the step's
    [sum, count] mean is Megatron-LM's mean over micro-batches (empty without multi-token prediction here)."""
    return {f"mtp_{k} loss": torch.stack([loss, torch.ones_like(loss)])
            for block in mtp_blocks([model]) for k, loss in enumerate(block.logged_losses, start=1)}
