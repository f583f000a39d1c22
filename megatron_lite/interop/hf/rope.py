"""RoPE and its scalings (linear, Llama 3, YaRN) in ``config.json`` (``rope_parameters`` in transformers >= 5,
``rope_scaling`` and ``rope_theta`` before) <-> our rotary fields; and the rows of weights whose outputs a family
rotates as interleaved channel pairs (``rotary_rows_reordered``)."""
from __future__ import annotations

import torch

from megatron_lite.config import YARN_DEFAULTS, ConfigError, ModelConfig
from megatron_lite.interop.hf.family import refuse


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# Megatron-LM's --use-rope-scaling fixes the original context (model/rope_scaling.py); the frequency factors are ours
# to set, these by default.
LLAMA3_CONTEXT = 8192
LLAMA3_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


YARN_FIELDS = ("rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int")


def rope_to_ours(hf: dict, *, partial_rotary: bool = False, latent: bool = False) -> dict:
    """RoPE base and scaling from ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta``;
    with ``partial_rotary`` (Phi-3) the rotated fraction of each head too. YaRN is --position-embedding-type
    yarn, or with multi-latent attention (``latent``, DeepSeek) --rope-type yarn."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    refuse(rope_type not in ROPE_TYPES,
           f"rope scaling {rope_type!r} (rope_parameters.rope_type; supported: {', '.join(ROPE_TYPES)})")
    fields = {"rotary_base": float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))}
    rotary_percent = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    refuse(rotary_percent != 1.0 and not partial_rotary, "rope_parameters.partial_rotary_factor other than 1")
    if partial_rotary:
        fields["rotary_percent"] = rotary_percent
    if rope_type == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(rope.pop("factor"))
    elif rope_type == "llama3":
        fields.update(use_rope_scaling=True, rope_scaling_factor=float(rope.pop("factor")),
                      **{f"rope_scaling_{name}": float(rope.pop(name, value))
                         for name, value in LLAMA3_FACTORS.items()})
        context = rope.pop("original_max_position_embeddings", LLAMA3_CONTEXT)
        refuse(context != LLAMA3_CONTEXT,
               f"rope_parameters.original_max_position_embeddings {context} other than {LLAMA3_CONTEXT} with rope_type "
               f"llama3 (Megatron-LM's --use-rope-scaling fixes it)")
    elif rope_type == "yarn":
        fields.update(_yarn_to_ours(rope, hf), **({"rope_type": "yarn"} if latent else
                                                  {"position_embedding_type": "yarn"}))
    refuse(bool(rope), f"rope_parameters field(s) {', '.join(sorted(rope))} with rope_type {rope_type!r}")
    return fields


def _yarn_to_ours(rope: dict, hf: dict) -> dict:
    """YaRN's fields, taken out of ``rope``. transformers scales the rotated channels by mscale(f, mscale) /
    mscale(f, mscale_all_dim) only when both are set (non-zero), else by mscale(f, 1): Megatron-LM's formula
    with --mscale 1 --mscale-all-dim 0. Only one of them set means something else to each: refused."""
    refuse("factor" not in rope, "rope_type yarn without rope_parameters.factor")
    mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    refuse(bool(mscale) != bool(mscale_all_dim),
           f"rope_parameters.mscale {mscale} with mscale_all_dim {mscale_all_dim} (transformers reads mscale only "
           f"with a non-zero mscale_all_dim; give both or neither)")
    refuse(rope.pop("attention_factor", None) is not None, "rope_parameters.attention_factor (YaRN's concentration "
                                                           "given outright, not from mscale and mscale_all_dim)")
    # transformers prefers a top-level original_max_position_embeddings (Phi-3), then rope_parameters', then
    # the model's own context.
    original = hf.get("original_max_position_embeddings") or rope.pop("original_max_position_embeddings",
                                                                      hf["max_position_embeddings"])
    rope.pop("original_max_position_embeddings", None)
    return dict(rotary_scaling_factor=float(rope.pop("factor")), mscale=float(mscale or 1.0),
                mscale_all_dim=float(mscale_all_dim or 0.0), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.pop("beta_fast", None) or YARN_DEFAULTS["yarn_beta_fast"]),
                yarn_beta_slow=float(rope.pop("beta_slow", None) or YARN_DEFAULTS["yarn_beta_slow"]),
                yarn_correction_range_round_to_int=bool(rope.pop("truncate", True)))


def rotary_rows_reordered(weight: torch.Tensor, block: int, rotary: int, *, to_interleaved: bool) -> torch.Tensor:
    """``weight``'s rows are blocks of ``block`` rows whose last ``rotary`` rows are rotated channels: those
    reordered from interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's, Llama 4's complex-number RoPE) to
    [even; odd], the halves ours rotate, pairing channel i with i + rotary/2 (or back, ``to_interleaved``): our
    rotation of the reordered channels computes theirs (docs/reference.md section 12). Any trailing dims (LoRA's
    B is [rows, r]) come along."""
    order = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2)])
    if to_interleaved:
        order = torch.argsort(order)
    blocks = weight.reshape(-1, block, *weight.shape[1:])
    rotated = blocks[:, block - rotary:][:, order]
    return torch.cat([blocks[:, :block - rotary], rotated], dim=1).reshape(weight.shape)


def rope_to_hf(config: ModelConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rotary_seq_len_interpolation_factor is not None:
        rope.update(rope_type="linear", factor=config.rotary_seq_len_interpolation_factor)
    elif config.use_rope_scaling:
        rope.update(rope_type="llama3", factor=config.rope_scaling_factor,
                    low_freq_factor=config.rope_scaling_low_freq_factor,
                    high_freq_factor=config.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=LLAMA3_CONTEXT)
    elif config.yarn:
        rope.update(_yarn_to_hf(config))
    # transformers < 5 reads rope_theta (and rope_scaling), 5 reads rope_parameters
    legacy = {"rope_scaling": rope} if rope["rope_type"] != "default" else {}
    return {"rope_theta": config.rotary_base, "rope_parameters": rope, **legacy}


def _yarn_to_hf(config: ModelConfig) -> dict:
    mscales = (config.mscale, config.mscale_all_dim)
    if mscales != (1.0, 0.0) and 0.0 in mscales:
        raise ConfigError(f"--mscale {config.mscale} with --mscale-all-dim {config.mscale_all_dim} has no Hugging Face "
                          f"form: transformers reads YaRN's mscale only when both are non-zero (or takes 1 and 0).")
    rope = {"rope_type": "yarn", "factor": config.rotary_scaling_factor,
            "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
            "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow,
            "truncate": config.yarn_correction_range_round_to_int}
    return rope if mscales == (1.0, 0.0) else dict(rope, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)
