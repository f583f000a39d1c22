"""Multi-latent attention (DeepSeek-V2/V3, ``--multi-latent-attention``): keys and values of every head
are expanded from one small latent per token, so a generation cache holds the latent instead of them
(docs/reference.md section 16, "Multi-latent attention").

    query:      hidden -> [linear_q_down_proj -> q_layernorm -> linear_q_up_proj]   (or linear_q_proj alone,
                                                                                   --q-lora-rank unset)
                each head [qk_head_dim channels | qk_pos_emb_head_dim channels rotated]
    latent:     hidden -> linear_kv_down_proj -> [kv_lora_rank channels | qk_pos_emb_head_dim channels]
                                                   kv_layernorm                  rotated: the rotary key, one
                                                   linear_kv_up_proj             for every head
                each head [key: qk_head_dim channels | value: v_head_dim channels]
    key:        each head's key channels, then the shared rotary key; attention as usual, then linear_proj.

Position enters only through the rotary channels, which bypass the latent: that is what lets the
latent be cached before any position-dependent step ("decoupled" RoPE). The softmax scale is
1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times YaRN's mscale^2 (``rope_scaling.mla_softmax_scale``);
``--qk-layernorm`` puts the RMSNorms on the latents (Megatron-LM's meaning with MLA).

Tensor parallelism splits the heads, as Megatron-LM does: the up-projections are column-parallel and the
output projection row-parallel. The down-projections are small and replicated (every rank computes the
whole latent, which every head needs); the backward of the column-parallel up-projections sums their
input's gradient over the ranks, so the latents' gradients are whole on every rank. The rotary key is used
by this rank's heads only, so it goes through the same conjugate pair by hand: an all-reduce of its
gradient, or under sequence parallelism an all-gather of the sequence whose backward reduce-scatters.
Under sequence parallelism the down-projections and latent norms see this rank's tokens only, and their
gradients are summed over the group by ``finalize_model_grads`` like other norm weights'.

Under context parallelism everything up to the core attention works on this rank's positions (the rotary
channels rotated at their true positions), and the core exchanges the expanded keys and values of this
rank's heads as it does grouped-query attention's (``context_parallel/attention.py``). Exchanging the latent
instead would send fewer bytes (kv_lora_rank + qk_pos_emb_head_dim per token against heads x (qk_head_dim +
qk_pos_emb_head_dim + v_head_dim)) but needs the up-projection of every rank's keys on every rank.
"""
import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig, attend_own_chunks
from megatron_lite.model.document_rows import core_attention_input
from megatron_lite.model.dot_product_attention import build_core_attention
from megatron_lite.model.embedding import apply_rotary, layer_rotary_concentration
from megatron_lite.model.norm import Norm
from megatron_lite.model.rope_scaling import mla_softmax_scale
from megatron_lite.process_groups import collectives
from megatron_lite.tensor_parallel import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                           TensorParallelConfig, copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region)
from megatron_lite.tensor_parallel.random import checkpoint


class MultiLatentAttention(nn.Module):
    """The same interface as ``SelfAttention``: ``forward(hidden_states, rotary_freqs, attention_mask,
    inference_context)`` -> (output, bias) before the residual."""

    def __init__(self, config: ModelConfig, *, layer_number: int, tp_config: TensorParallelConfig,
                 context_parallel: ContextParallelConfig | None = None, checkpoint_core_attention: bool = False):
        super().__init__()
        self.layer_number = layer_number  # names this layer's entry in a generation's cache
        self.tp_group, self.sequence_parallel = tp_config.tp_group, tp_config.sequence_parallel
        tp_size = collectives.world_size(self.tp_group)
        if config.num_attention_heads % tp_size:
            raise ValueError(f"{config.num_attention_heads} attention heads do not split over {tp_size} "
                             f"tensor-parallel ranks: each rank holds whole heads.")
        self.qk_head_dim, self.rotary_dim, self.v_head_dim = (config.qk_head_dim, config.qk_pos_emb_head_dim,
                                                              config.v_head_dim)
        self.kv_lora_rank = config.kv_lora_rank
        self.core_attention = build_core_attention(config, layer_number=layer_number,
                                                   softmax_scale=mla_softmax_scale(config),
                                                   context_parallel=context_parallel)
        self.context_parallel = context_parallel
        self.checkpoint_core_attention = checkpoint_core_attention
        self.rotary_concentration = layer_rotary_concentration(config, layer_number)
        heads, hidden = config.num_attention_heads, config.hidden_size
        latent = dict(bias=False, sequence_parallel=tp_config.sequence_parallel, params_dtype=tp_config.params_dtype)
        query_width = heads * (self.qk_head_dim + self.rotary_dim)
        self.query_from_latent = config.q_lora_rank is not None
        if not self.query_from_latent:
            self.linear_q_proj = ColumnParallelLinear(hidden, query_width, bias=False, tp_config=tp_config)
        else:
            self.linear_q_down_proj = ReplicatedLinear(hidden, config.q_lora_rank, **latent)
            self.q_layernorm = _latent_norm(config, config.q_lora_rank, tp_config)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, query_width, bias=False,
                                                         tp_config=tp_config)
        self.linear_kv_down_proj = ReplicatedLinear(hidden, self.kv_lora_rank + self.rotary_dim, **latent)
        self.kv_layernorm = _latent_norm(config, self.kv_lora_rank, tp_config)
        self.linear_kv_up_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim),
                                                      bias=False, tp_config=tp_config)
        self.linear_proj = RowParallelLinear(heads * self.v_head_dim, hidden, tp_config=tp_config,
                                             bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor,
                attention_mask: torch.Tensor | None = None, position_ids=None, inference_context=None,
                positions_are_columns: bool = False):
        """[s, b, h] (or [s/tp, b, h] under sequence parallelism) -> (output, bias) before the residual; the
        mask and the cache as ``SelfAttention``'s, the cache holding the latent and the rotary key."""
        query = self._query(hidden_states, rotary_freqs)
        latent, rotary_key = self._latent(hidden_states, rotary_freqs)
        if inference_context is not None:
            latent, rotary_key = inference_context.append_key_value(self.layer_number, latent, rotary_key)
        key, value = self._keys_and_values(latent, rotary_key)
        attention_mask = core_attention_input(attention_mask, self.context_parallel)
        if inference_context is not None and inference_context.splits_sequence:  # the cache gathered the latent
            context = attend_own_chunks(self.core_attention, query, key, value, attention_mask,
                                        inference_context.context_parallel)
        elif self.checkpoint_core_attention and self.training:
            context = checkpoint(self.core_attention, query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)

    def _query(self, hidden_states, rotary_freqs):
        """This rank's heads' queries [s, b, heads, qk_head_dim + qk_pos_emb_head_dim], the last channels rotated."""
        if self.query_from_latent:
            query, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden_states)))
        else:
            query, _ = self.linear_q_proj(hidden_states)
        query = query.view(*query.shape[:2], -1, self.qk_head_dim + self.rotary_dim)
        content, rotary = query.split([self.qk_head_dim, self.rotary_dim], dim=-1)
        return torch.cat([content, apply_rotary(rotary, rotary_freqs, self.rotary_concentration)], dim=-1)

    def _latent(self, hidden_states, rotary_freqs):
        """(the normalised key/value latent [s, b, kv_lora_rank] ([s/tp, ...] under sequence parallelism), the
        rotated rotary key [s, b, 1, qk_pos_emb_head_dim] of the whole sequence), as generation caches them."""
        latent, rotary_key = self.linear_kv_down_proj(hidden_states).split([self.kv_lora_rank, self.rotary_dim],
                                                                           dim=-1)
        # This rank's heads use the rotary key: their gradients are summed over the group on the way back.
        if self.sequence_parallel:
            rotary_key = gather_from_sequence_parallel_region(rotary_key, self.tp_group,
                                                              tensor_parallel_output_grad=True)
        else:
            rotary_key = copy_to_tensor_model_parallel_region(rotary_key, self.tp_group)
        rotary_key = apply_rotary(rotary_key.unsqueeze(2), rotary_freqs, self.rotary_concentration)
        return self.kv_layernorm(latent), rotary_key

    def _keys_and_values(self, latent, rotary_key):
        """This rank's heads' keys [s, b, heads, qk_head_dim + qk_pos_emb_head_dim] and values [s, b, heads,
        v_head_dim] from the latent (the up-projection gathers the sequence under sequence parallelism)."""
        key_value, _ = self.linear_kv_up_proj(latent)
        key_value = key_value.view(*key_value.shape[:2], -1, self.qk_head_dim + self.v_head_dim)
        key, value = key_value.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        return torch.cat([key, rotary_key.expand(*key.shape[:3], -1)], dim=-1), value


def _latent_norm(config: ModelConfig, width: int, tp_config: TensorParallelConfig) -> nn.Module:
    """``--qk-layernorm``'s RMSNorm (or LayerNorm) of a latent, else the identity."""
    if not config.qk_layernorm:
        return nn.Identity()
    return Norm(width, normalization=config.normalization, eps=config.norm_epsilon,
                apply_layernorm_1p=config.apply_layernorm_1p, sequence_parallel=tp_config.sequence_parallel,
                params_dtype=tp_config.params_dtype)
