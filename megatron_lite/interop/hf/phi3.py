"""Phi-3 (``Phi3ForCausalLM``): Mistral's fields with fused qkv_proj and gate_up_proj and a partial rotary
factor."""
from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.interop.hf.family import Family, refuse
from megatron_lite.interop.hf.llama import LLAMA_FIELDS
from megatron_lite.interop.hf.mistral import mistral_to_hf, mistral_to_ours
from megatron_lite.interop.hf.rope import rope_to_ours


def _phi3_to_ours(hf: dict) -> dict:
    refuse(hf.get("resid_pdrop", 0.0) != hf.get("embd_pdrop", 0.0),
           "embd_pdrop different from resid_pdrop (our --hidden-dropout is both)")
    # Mistral's fields, but RoPE read again to take partial_rotary_factor, which Mistral refuses.
    fields = dict(mistral_to_ours({**hf, "rope_parameters": None, "rope_scaling": None}),
                  hidden_dropout=hf.get("resid_pdrop", 0.0))
    return dict(fields, **rope_to_ours(hf, partial_rotary=True))


def _phi3_to_hf(config: ModelConfig) -> dict:
    fields = dict(mistral_to_hf(config), resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout)
    fields["rope_parameters"] = dict(fields["rope_parameters"], partial_rotary_factor=config.rotary_percent)
    return fields


# Named as Llama but with q/k/v and gate/up fused; exported only when asked for (--hf-model-type phi3).
PHI3 = Family("phi3", "Phi3ForCausalLM", "phi3",
              LLAMA_FIELDS | {"sliding_window", "resid_pdrop", "embd_pdrop", "partial_rotary_factor",
                              "original_max_position_embeddings"},  # the context longrope scaling starts from
              _phi3_to_ours, _phi3_to_hf)
