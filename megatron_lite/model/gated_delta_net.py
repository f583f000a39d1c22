"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5; Megatron-LM's --experimental-attention-variant gdn): the
token mixer of the layers --linear-attention-freq picks, in place of softmax attention (docs/reference.md,
"Gated DeltaNet").

    in_proj     hidden -> per key head h: [q_h, k_h, its value heads' v, z (the output gate), b, a]
    conv1d      q, k, v through a short causal depthwise convolution (--linear-conv-kernel-dim), then SiLU
    scan        the gated delta rule (delta_rule.py) per value head: q and k L2-normalised (q times dk^-1/2),
                beta = sigmoid(b), decay g = -exp(A_log) softplus(a + dt_bias); each query/key head serves
                --linear-num-value-heads / --linear-num-key-heads value heads
    out_norm    RMSNorm of each value head's output, times SiLU(z) (a gated norm; its weight is the scale)
    out_proj    value heads -> hidden

Tensor parallelism splits the key heads, each with its value heads: in_proj is column-parallel (its rows laid out
per key head, so a contiguous shard holds whole heads), the convolution's channels and the per-head A_log and
dt_bias are split alike, out_proj is row-parallel. The gated norm's weight is shared by every head, so each
rank's gradient is a partial sum, all-reduced as a sequence-parallel norm's (its ``sequence_parallel`` mark).

The convolution and the scan carry state along the sequence, so packed documents each get a row of their own
(``document_rows``: in training grouped by length, as attention's rows), where both start from zero. Generation
keeps each layer's last K - 1 convolution inputs and its scan state in the inference context
(``StaticInferenceContext.recurrent_state``): a step then costs one token's work, as the key/value cache does for
attention. There is no context parallelism (config/__init__.py refuses it): a rank's chunk would need the state
the ranks before it reach.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.delta_rule import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from megatron_lite.model.document_rows import DocumentRows, document_buckets, document_starts
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelConfig,
                                           set_tensor_model_parallel_attributes)
from megatron_lite.tensor_parallel.random import checkpoint

# Decoding steps of at most this many tokens run the recurrence token by token rather than in chunks.
RECURRENT_STEP_TOKENS = 1


class GatedDeltaNet(nn.Module):
    """The same interface as ``SelfAttention``: ``forward(hidden_states, rotary_freqs, attention_mask,
    inference_context)`` -> (output, bias) before the residual; rotary embeddings are not used."""

    def __init__(self, config: ModelConfig, *, layer_number: int, tp_config: TensorParallelConfig,
                 context_parallel=None, checkpoint_core_attention: bool = False):
        super().__init__()
        if context_parallel is not None:
            raise ValueError("a gated DeltaNet layer has no context parallelism: its scan runs the whole sequence.")
        self.layer_number = layer_number  # names this layer's state in a generation's inference context
        tp_size = collectives.world_size(tp_config.tp_group)
        if config.linear_num_key_heads % tp_size:
            raise ValueError(f"{config.linear_num_key_heads} gated DeltaNet key heads do not split over {tp_size} "
                             f"tensor-parallel ranks: each rank holds whole heads.")
        self.key_heads = config.linear_num_key_heads // tp_size
        self.values_per_key = config.linear_num_value_heads // config.linear_num_key_heads
        self.value_heads = self.key_heads * self.values_per_key
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.checkpoint_scan = checkpoint_core_attention
        group_values = self.values_per_key * self.value_dim
        # Per key head: [q, k, v | z | b, a]; the first three go through the convolution.
        self.group_split = [2 * self.key_dim + group_values, group_values, self.values_per_key, self.values_per_key]
        self.in_proj = ColumnParallelLinear(config.hidden_size, config.linear_num_key_heads * sum(self.group_split),
                                            tp_config=tp_config, bias=False)
        conv_channels = self.key_heads * self.group_split[0]
        self.conv1d = nn.Conv1d(conv_channels, conv_channels, self.kernel_size, groups=conv_channels, bias=False,
                                dtype=tp_config.params_dtype)
        self.A_log = nn.Parameter(torch.empty(self.value_heads, dtype=tp_config.params_dtype))
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads, dtype=tp_config.params_dtype))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(param, is_parallel=True, partition_dim=0, partition_stride=1)
        # Mamba-2's range of decay rates (A in [1, 16]) and a neutral step bias (softplus(0 + 1)).
        self.A_log.full_init = lambda shape, generator: torch.empty(shape).uniform_(1, 16, generator=generator).log()
        self.dt_bias.full_init = lambda shape, generator: torch.ones(shape)
        self.out_norm = GatedRMSNorm(self.value_dim, eps=config.norm_epsilon, params_dtype=tp_config.params_dtype,
                                     sequence_parallel=tp_size > 1)
        self.out_proj = RowParallelLinear(config.linear_num_value_heads * self.value_dim, config.hidden_size,
                                          tp_config=tp_config, bias=False, input_is_parallel=True,
                                          skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor, rotary_freqs=None, attention_mask: torch.Tensor | None = None,
                position_ids=None, inference_context=None, positions_are_columns: bool = False):
        """[s, b, h] (or [s/tp, b, h] under sequence parallelism) -> (output, bias); ``attention_mask`` as
        ``SelfAttention``'s, read only for where documents start."""
        projected, _ = self.in_proj(hidden_states)  # the whole sequence, this rank's heads
        seq, batch = projected.shape[:2]
        mixed, gate, b, a = projected.view(seq, batch, self.key_heads, -1).split(self.group_split, dim=-1)
        # Positions first from here on ([b, s, ...]), as the rows of documents are.
        mixed = mixed.reshape(seq, batch, -1).transpose(0, 1)
        beta = b.sigmoid().reshape(seq, batch, -1).transpose(0, 1).float()
        decay = -self.A_log.float().exp() * F.softplus(a.reshape(seq, batch, -1).transpose(0, 1).float()
                                                       + self.dt_bias)
        if inference_context is None:
            documents = document_buckets(attention_mask, seq, batch, projected.device)
            ones = torch.ones(batch, seq, 1, device=projected.device)  # in rows: 1 at a document's tokens
            output = documents.apply(self._scan_rows, mixed, beta, decay, ones)
        else:
            output = self._generate(mixed, beta, decay, attention_mask, inference_context)
        output = output.transpose(0, 1)  # [s, b, value heads, dv]
        output = self.out_norm(output, gate.reshape(seq, batch, self.value_heads, self.value_dim))
        return self.out_proj(output.reshape(seq, batch, -1))

    def _scan_rows(self, mixed, beta, decay, valid):
        """The scan's outputs over rows of whole documents ([n, L, ...]; ``valid`` [n, L, 1]: 1 at their tokens, 0
        after an end, where nothing is written and nothing decays), keeping no state."""
        scan_inputs = (mixed, beta * valid, decay * valid)
        if self.checkpoint_scan and self.training:  # --recompute-granularity selective: the scan's activations
            return checkpoint(self._scan_outputs, *scan_inputs)
        return self._scan_outputs(*scan_inputs)

    def _scan_outputs(self, mixed, beta, decay):
        """``_scan``'s outputs without a state (what a recomputed region may return)."""
        return self._scan(mixed, beta, decay, None, None, False)[0]

    def _generate(self, mixed, beta, decay, attention_mask, inference_context):
        """The scan's outputs [b, s, value heads, dv] of new tokens after the cached state, one row per document
        (generation's left padding makes each padding token one), and the state each batch row ends in cached."""
        state = inference_context.recurrent_state(self.layer_number)
        batch, seq = mixed.shape[:2]
        documents = DocumentRows(document_starts(attention_mask, seq, batch, continues=state is not None,
                                                 device=mixed.device))
        valid = documents.valid(torch.float32, mixed.device)[..., None]  # no write, no decay after an end
        output, new_state = self._scan(documents.to_rows(mixed), documents.to_rows(beta) * valid,
                                       documents.to_rows(decay) * valid, documents, state, True)
        inference_context.set_recurrent_state(self.layer_number, new_state)
        return documents.from_rows(output)

    def _scan(self, mixed, beta, decay, documents: DocumentRows, state, generating: bool):
        """The convolution and the gated delta rule over the document rows ([n, L, ...]), after ``state`` (the
        cached (convolution inputs, scan state) of each batch row) where given: (the outputs [n, L, value heads,
        dv], when ``generating`` the state each batch row ends in, else None)."""
        rows = mixed.shape[0]
        history = mixed.new_zeros(rows, self.kernel_size - 1, mixed.shape[-1])
        initial = None
        if state is not None:  # a generation's rows continue where their last step ended
            conv_state, scan_state = (x * documents.continues.view(-1, *[1] * (x.dim() - 1)) for x in state)
            history = history.index_copy(0, documents.first_of_row, conv_state.to(mixed.dtype))
            initial = scan_state.new_zeros(rows, *scan_state.shape[1:]).index_copy(0, documents.first_of_row,
                                                                                   scan_state)
        extended = torch.cat([history, mixed], dim=1)
        convolved = F.conv1d(extended.transpose(1, 2).contiguous(), self.conv1d.weight, groups=mixed.shape[-1])
        convolved = F.silu(convolved).transpose(1, 2)
        length = mixed.shape[1]
        query, key, value = convolved.reshape(rows, length, self.key_heads, -1).split(
            [self.key_dim, self.key_dim, self.group_split[0] - 2 * self.key_dim], dim=-1)
        query = l2_normalize(query.float()) * self.key_dim ** -0.5
        key = l2_normalize(key.float())
        # Each query/key head serves its value heads, which follow one another.
        query, key = (x.repeat_interleave(self.values_per_key, dim=2) for x in (query, key))
        value = value.reshape(rows, length, self.value_heads, self.value_dim).float()
        rule = recurrent_gated_delta_rule if length <= RECURRENT_STEP_TOKENS else chunk_gated_delta_rule
        output, final = rule(query, key, value, decay, beta, initial)
        new_state = None
        if generating:
            # The last K - 1 convolution inputs before each batch row's end, and the scan state there.
            ends = documents.lengths[documents.last_of_row]
            window = ends[:, None] + torch.arange(self.kernel_size - 1, device=ends.device)
            conv_state = extended[documents.last_of_row[:, None], window]
            new_state = (conv_state, final[documents.last_of_row])
        return output.to(mixed.dtype), new_state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (float32), times SiLU of its gate: [..., d] and gate [..., d] in."""

    def __init__(self, width: int, *, eps: float, params_dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width, dtype=params_dtype))
        self.weight.full_init = lambda shape, generator: torch.ones(shape)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().square().mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)
