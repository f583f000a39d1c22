"""Token (vocab-parallel) and position embeddings, and rotary position angles and their application."""
import contextlib
import dataclasses

import torch
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import ModelConfig
from megatron_lite.model.rope_scaling import rotary_concentration, scaled_inverse_frequencies
from megatron_lite.model.sliding_window import is_local_layer
from megatron_lite.tensor_parallel import VocabParallelEmbedding, scatter_to_sequence_parallel_region
from megatron_lite.tensor_parallel.random import get_rng_tracker
from megatron_lite.tensor_parallel.config import TensorParallelConfig


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, *, padded_vocab_size: int, tp_config: TensorParallelConfig):
        super().__init__()
        self.tp_group = tp_config.tp_group
        self.sequence_parallel = tp_config.sequence_parallel
        params_dtype = tp_config.params_dtype
        # Whole sequences from the lookup: positions are added before the sequence is scattered.
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, config.hidden_size, tp_config=dataclasses.replace(tp_config, sequence_parallel=False))
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            # Allocated, not initialised, like every weight here (weight_init.py initialises them all): the
            # default init would draw normals for nothing, and on the meta device (parameter counting) its
            # first normal_ imports PyTorch's meta kernels, a second of start-up.
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size,
                _weight=torch.empty(config.max_position_embeddings, config.hidden_size, dtype=params_dtype))
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.scale_embeddings = config.scale_embeddings
        self.frozen_token = config.pad_token_id if config.freeze_padding_embedding else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] (or [s/tp, b, h] under sequence parallelism)."""
        token_ids = input_ids.t().contiguous()
        embeddings = self.word_embeddings(token_ids)
        if self.frozen_token is not None:
            # transformers' padding_idx: the lookup at pad positions passes no gradient, so the row gets none from
            # the input side (with tied weights the output layer's gradient of it still flows, as there). Cut
            # after the vocabulary-parallel lookup's reduction, so no tensor-parallel rank sees one, and before
            # the buffers: ZeRO's shards, the grad norm and Adam find the row's gradient zero.
            embeddings = torch.where((token_ids == self.frozen_token)[..., None], embeddings.detach(), embeddings)
        if self.scale_embeddings:  # Gemma: the factor rounded to the embeddings' dtype, as transformers does
            embeddings = embeddings * torch.tensor(embeddings.shape[-1] ** 0.5, dtype=embeddings.dtype)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids.t())
        if self.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)
            # Each rank now holds different tokens: draw its own dropout mask.
            with get_rng_tracker().fork() if self.training and self.dropout.p > 0 else contextlib.nullcontext():
                return self.dropout(embeddings)
        return self.dropout(embeddings)


@dataclasses.dataclass(frozen=True)
class RotaryAngles:
    """The rotary angles of a batch's positions for every layer, each [s, b, 1, d] (``rotary_freqs``).

    ``global_angles`` (--rotary-base, under the model's RoPE scaling) serve every layer, except that with
    --rotary-base-local (Gemma 3) the local, sliding-window layers take ``local_angles``: their own base,
    never scaled (Gemma 3 stretches only its global layers' context; docs/reference.md section 12)."""

    global_angles: torch.Tensor
    local_angles: torch.Tensor | None = None

    def of_layer(self, local: bool) -> torch.Tensor:
        """The angles of a layer that is ``local`` (attends through a window) or global."""
        return self.local_angles if local and self.local_angles is not None else self.global_angles


def rotary_angles(position_ids: torch.Tensor, config: ModelConfig) -> RotaryAngles:
    """The angles of ``position_ids`` [b, s] for every layer of the model ``config``."""
    local = config.rotary_base_local
    return RotaryAngles(rotary_freqs(position_ids, config.rotary_dim, config.rotary_base, scaling=config),
                        None if local is None else rotary_freqs(position_ids, config.rotary_dim, local))


def layer_rotary_concentration(config: ModelConfig, layer_number: int) -> float:
    """What layer ``layer_number`` (global, 0-based) multiplies its rotated channels by: YaRN's concentration
    (``rope_scaling.rotary_concentration``) goes with the scaled angles, so a layer that takes ``RotaryAngles``'
    unscaled local angles (a sliding-window layer under --rotary-base-local) takes 1."""
    takes_local_angles = config.rotary_base_local is not None and is_local_layer(config, layer_number)
    return 1.0 if takes_local_angles else rotary_concentration(config)


def rotary_freqs(position_ids: torch.Tensor, rotary_dim: int, base: float,
                 scaling: ModelConfig | None = None) -> torch.Tensor:
    """Angles position * base^(-2i/d) of every token, laid out [s, b, 1, d] as cat(freqs, freqs)
    (rotate-half RoPE); position_ids is [b, s], so packed sequences can restart positions per example.
    When every sample has the same positions (no packing) the angles are one row, [s, 1, 1, d], which
    the rotation broadcasts over the batch: every layer then takes the sines and cosines of s positions,
    not of s x b.

    ``d`` is the rotated width: the head dimension, or its first ``--rotary-percent`` (then the
    frequencies span that width, as in Megatron-LM and GPT-NeoX, and the other channels pass through).
    ``scaling``: the model whose RoPE scaling (``rope_scaling.py``) applies, if any.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=position_ids.device)
                               / rotary_dim))
    if scaling is not None:
        inv_freq = scaled_inverse_frequencies(inv_freq, scaling)
    if not position_ids.is_cuda and len(position_ids) > 1 and bool((position_ids == position_ids[:1]).all()):
        # Read on the CPU only: on a GPU the comparison would wait for the device, and the fused kernel
        # computes per-sample angles as fast as shared ones.
        position_ids = position_ids[:1]
    freqs = position_ids.t().float()[..., None] * inv_freq  # [s, b, d/2]
    return torch.cat([freqs, freqs], dim=-1)[:, :, None, :]


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor, concentration: float = 1.0) -> torch.Tensor:
    """x [s, b, heads, d] rotated by ``rotary_freqs``' angles (its first ``freqs.shape[-1]`` channels; the rest
    pass through), the rotated channels then multiplied by ``concentration`` (YaRN's, ``rope_scaling.py``)."""
    rotated = kernels.apply_rotary_pos_emb(x, freqs)
    if concentration == 1.0:
        return rotated
    width = freqs.shape[-1]
    return torch.cat([rotated[..., :width] * concentration, rotated[..., width:]], dim=-1)
