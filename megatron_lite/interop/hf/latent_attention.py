"""DeepSeek-V2/V3's attention weights (transformers' naming) <-> our multi-latent attention's.

    theirs (self_attn.)        ours (self_attention.)
    q_proj                     linear_q_proj          (no --q-lora-rank)
    q_a_proj, q_a_layernorm    linear_q_down_proj, q_layernorm
    q_b_proj                   linear_q_up_proj
    kv_a_proj_with_mqa         linear_kv_down_proj    [latent rows; rotary key rows]
    kv_a_layernorm, kv_b_proj  kv_layernorm, linear_kv_up_proj
    o_proj                     linear_proj            (as Llama's, weights)

Each head's query rows are [qk_nope_head_dim; qk_rope_head_dim] in both, and so are kv_b_proj's
[key; value] rows per head: the weights only change name, except for the order of the rotary rows.
DeepSeek's released weights rotate interleaved channel pairs (x0, x1), (x2, x3), ... (V2 always; V3
when ``rope_interleave``, its default); ours rotate halves, pairing channel i with i + r/2, as Llama.
Reordering the rotary rows of q_proj / q_b_proj (per head) and of kv_a_proj_with_mqa to [even; odd]
makes our rotation compute exactly theirs (docs/reference.md section 12);
export writes them back interleaved, with ``rope_interleave`` true.
"""
from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.rope import rotary_rows_reordered

_NORMS = (("kv_a_layernorm.weight", "kv_layernorm.weight"), ("kv_b_proj.weight", "linear_kv_up_proj.weight"))
_QUERY_LATENT = (("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"))


def query_rotary_rows(weight: torch.Tensor, config: ModelConfig, *, to_interleaved: bool) -> torch.Tensor:
    """q_proj's or q_b_proj's rows (every head's) with the rotary rows reordered."""
    return rotary_rows_reordered(weight, config.qk_head_dim + config.qk_pos_emb_head_dim, config.qk_pos_emb_head_dim,
                                  to_interleaved=to_interleaved)


def latent_rotary_rows(weight: torch.Tensor, config: ModelConfig, *, to_interleaved: bool) -> torch.Tensor:
    """kv_a_proj_with_mqa's rows with the rotary key's rows reordered."""
    return rotary_rows_reordered(weight, config.kv_lora_rank + config.qk_pos_emb_head_dim,
                                  config.qk_pos_emb_head_dim, to_interleaved=to_interleaved)


def _query_weight_name(config: ModelConfig) -> tuple[str, str]:
    return (("q_b_proj.weight", "linear_q_up_proj.weight") if config.q_lora_rank is not None
            else ("q_proj.weight", "linear_q_proj.weight"))


def _renames(config: ModelConfig) -> tuple:
    return _NORMS + (_QUERY_LATENT if config.q_lora_rank is not None else ())


def latent_attention_from_hf(take, theirs: str, ours: str, config: ModelConfig, *, interleaved: bool) -> dict:
    """One layer's attention weights but o_proj, ``take(name)`` removing them from the Hugging Face state dict;
    ``theirs`` and ``ours`` are the layer prefixes, ``interleaved`` whether the file rotates interleaved pairs."""
    theirs, ours = theirs + "self_attn.", ours + "self_attention."
    query_theirs, query_ours = _query_weight_name(config)
    query, latent = take(theirs + query_theirs), take(theirs + "kv_a_proj_with_mqa.weight")
    if interleaved:
        query = query_rotary_rows(query, config, to_interleaved=False)
        latent = latent_rotary_rows(latent, config, to_interleaved=False)
    weights = {ours + query_ours: query, ours + "linear_kv_down_proj.weight": latent}
    weights.update({ours + mine: take(theirs + hf_name) for hf_name, mine in _renames(config)})
    return weights


def latent_attention_to_hf(read, theirs: str, ours: str, config: ModelConfig) -> dict:
    """The inverse of ``latent_attention_from_hf``, written with interleaved rotary rows."""
    theirs, ours = theirs + "self_attn.", ours + "self_attention."
    query_theirs, query_ours = _query_weight_name(config)
    weights = {theirs + query_theirs: query_rotary_rows(read(ours + query_ours), config, to_interleaved=True),
               theirs + "kv_a_proj_with_mqa.weight": latent_rotary_rows(read(ours + "linear_kv_down_proj.weight"),
                                                                        config, to_interleaved=True)}
    weights.update({theirs + hf_name: read(ours + mine) for hf_name, mine in _renames(config)})
    return weights
