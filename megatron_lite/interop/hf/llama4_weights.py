"""Llama 4's tensors beyond Llama's names (``weights`` maps those: embeddings, norms, v_proj, o_proj) <-> ours, one
layer at a time.

    theirs (model.layers.{i}.)                    ours (decoder.layers.{i}.)
    self_attn.q_proj, k_proj                      self_attention.linear_qkv's q and k rows, reordered
    feed_forward.gate_proj, up_proj, down_proj    mlp.linear_fc1 [gate; up], linear_fc2 (a dense layer)
    feed_forward.router                           mlp.router
    feed_forward.experts.gate_up_proj [E, h, 2f]  mlp.experts.local_experts.{e}.linear_fc1 [2f, h]
    feed_forward.experts.down_proj [E, f, h]      mlp.experts.local_experts.{e}.linear_fc2 [h, f]
    feed_forward.shared_expert.gate_proj, ...     mlp.shared_experts.linear_fc1 [gate; up], linear_fc2

Llama 4 rotates interleaved channel pairs (its RoPE multiplies complex numbers): each head's q and k rows are
reordered to our halves (``rope.rotary_rows_reordered``), on every layer alike, as a NoPE layer's scores do not
depend on the order of the channels, nor does the q/k L2 norm. The experts are stacked as [in, out] (x @ W), each
gate_up_proj's columns [gate | up]: expert e's transposed is our fc1.
"""
from __future__ import annotations

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.interop.hf.rope import rotary_rows_reordered

_EXPERTS = "feed_forward.experts."
_SHARED = "feed_forward.shared_expert."


def llama4_rotary_rows(rows: torch.Tensor, config: ModelConfig, *, to_interleaved: bool) -> torch.Tensor:
    """q_proj's or k_proj's rows (or a LoRA B's) reordered between Llama 4's interleaved pairs and our halves."""
    return rotary_rows_reordered(rows, config.head_dim, config.head_dim, to_interleaved=to_interleaved)


def _gated_mlp_from_hf(take, theirs: str, mine: str) -> dict:
    return {mine + "linear_fc1.weight": torch.cat([take(theirs + "gate_proj.weight"), take(theirs + "up_proj.weight")]),
            mine + "linear_fc2.weight": take(theirs + "down_proj.weight")}


def _gated_mlp_to_hf(read, theirs: str, mine: str) -> dict:
    gate, up = read(mine + "linear_fc1.weight").chunk(2)
    return {theirs + "gate_proj.weight": gate, theirs + "up_proj.weight": up,
            theirs + "down_proj.weight": read(mine + "linear_fc2.weight")}


def llama4_mlp_from_hf(take, theirs: str, layer: str, config: ModelConfig, number: int) -> dict:
    """Layer ``number``'s feed_forward (``take(name)`` pops a tensor of the files) -> our mlp tensors."""
    if not config.is_moe_layer(number):
        return _gated_mlp_from_hf(take, theirs + "feed_forward.", layer + "mlp.")
    ours = {layer + "mlp.router.weight": take(theirs + "feed_forward.router.weight"),
            **_gated_mlp_from_hf(take, theirs + _SHARED, layer + "mlp.shared_experts.")}
    gate_up, down = take(theirs + _EXPERTS + "gate_up_proj"), take(theirs + _EXPERTS + "down_proj")
    if gate_up.shape[0] != config.num_experts:
        raise ConfigError(f"the Hugging Face weights hold {gate_up.shape[0]} experts in {theirs}{_EXPERTS}"
                          f"gate_up_proj, but its config.json says num_local_experts {config.num_experts}.")
    for e in range(config.num_experts):
        mine = f"{layer}mlp.experts.local_experts.{e}."
        ours[mine + "linear_fc1.weight"] = gate_up[e].t()
        ours[mine + "linear_fc2.weight"] = down[e].t()
    return ours


def llama4_mlp_to_hf(read, theirs: str, layer: str, config: ModelConfig, number: int) -> dict:
    """Inverse of ``llama4_mlp_from_hf``, ``read(name)`` reading our tensors."""
    if not config.is_moe_layer(number):
        return _gated_mlp_to_hf(read, theirs + "feed_forward.", layer + "mlp.")
    experts = [f"{layer}mlp.experts.local_experts.{e}." for e in range(config.num_experts)]
    return {theirs + "feed_forward.router.weight": read(layer + "mlp.router.weight"),
            **_gated_mlp_to_hf(read, theirs + _SHARED, layer + "mlp.shared_experts."),
            theirs + _EXPERTS + "gate_up_proj": torch.stack([read(mine + "linear_fc1.weight").t() for mine in experts]),
            theirs + _EXPERTS + "down_proj": torch.stack([read(mine + "linear_fc2.weight").t() for mine in experts])}
