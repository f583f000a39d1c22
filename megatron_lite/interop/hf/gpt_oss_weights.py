"""gpt-oss's tensors beyond Llama's names (``weights`` maps those: embeddings, norms, q/k/v/o and their biases)
<-> ours, one layer at a time.

    theirs (model.layers.{i}.)              ours (decoder.layers.{i}.)
    self_attn.o_proj.bias                   self_attention.linear_proj.bias
    self_attn.sinks [heads]                 self_attention.softmax_offset
    mlp.router.weight, .bias                mlp.router.weight, .bias
    mlp.experts.gate_up_proj [E, h, 2f]     mlp.experts.local_experts.{e}.linear_fc1.weight [2f, h]
    mlp.experts.gate_up_proj_bias [E, 2f]   mlp.experts.local_experts.{e}.linear_fc1.bias [2f]
    mlp.experts.down_proj [E, f, h]         mlp.experts.local_experts.{e}.linear_fc2.weight [h, f]
    mlp.experts.down_proj_bias [E, h]       mlp.experts.local_experts.{e}.linear_fc2.bias [h]

The experts are stacked, as [in, out] (x @ W), and gate_up_proj interleaves its columns, gate and up in turn
(gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...); ours is one fc1 per expert, [gate; up] by rows.
"""
from __future__ import annotations

import torch

from megatron_lite.config import ConfigError, ModelConfig

_RENAMED = (("self_attn.o_proj.bias", "self_attention.linear_proj.bias"),
            ("self_attn.sinks", "self_attention.softmax_offset"),
            ("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias"))
_EXPERTS = "mlp.experts."


def _ours(layer: str, expert: int, name: str) -> str:
    return f"{layer}mlp.experts.local_experts.{expert}.{name}"


def gpt_oss_layer_from_hf(take, theirs: str, layer: str, config: ModelConfig) -> dict:
    """Layer ``theirs`` (``take(name)`` pops a tensor of the files) -> our tensors of ``_RENAMED`` and the experts."""
    ours = {layer + mine: take(theirs + hf) for hf, mine in _RENAMED}
    gate_up, gate_up_bias, down, down_bias = (take(f"{theirs}{_EXPERTS}{name}") for name in (
        "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
    if gate_up.shape[0] != config.num_experts:
        raise ConfigError(f"the Hugging Face weights hold {gate_up.shape[0]} experts in {theirs}{_EXPERTS}"
                          f"gate_up_proj, but its config.json says num_local_experts {config.num_experts}.")
    for e in range(config.num_experts):
        ours[_ours(layer, e, "linear_fc1.weight")] = torch.cat([gate_up[e, :, 0::2].t(), gate_up[e, :, 1::2].t()])
        ours[_ours(layer, e, "linear_fc1.bias")] = torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]])
        ours[_ours(layer, e, "linear_fc2.weight")] = down[e].t()
        ours[_ours(layer, e, "linear_fc2.bias")] = down_bias[e]
    return ours


def gpt_oss_layer_to_hf(read, theirs: str, layer: str, config: ModelConfig) -> dict:
    """Inverse of ``gpt_oss_layer_from_hf``, ``read(name)`` reading our tensors."""
    hf = {theirs + name: read(layer + mine) for name, mine in _RENAMED}
    experts = range(config.num_experts)
    fc1 = [read(_ours(layer, e, "linear_fc1.weight")).t().chunk(2, dim=1) for e in experts]
    fc1_bias = [read(_ours(layer, e, "linear_fc1.bias")).chunk(2) for e in experts]
    hf[theirs + _EXPERTS + "gate_up_proj"] = torch.stack([_interleaved(gate, up) for gate, up in fc1])
    hf[theirs + _EXPERTS + "gate_up_proj_bias"] = torch.stack([_interleaved(gate, up) for gate, up in fc1_bias])
    hf[theirs + _EXPERTS + "down_proj"] = torch.stack([read(_ours(layer, e, "linear_fc2.weight")).t()
                                                       for e in experts])
    hf[theirs + _EXPERTS + "down_proj_bias"] = torch.stack([read(_ours(layer, e, "linear_fc2.bias")) for e in experts])
    return hf


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., f] gate and up -> [..., 2f], gate and up in turn along the last dimension."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def interleaved_rows(fc1_rows: torch.Tensor) -> torch.Tensor:
    """Rows laid out as our fc1's, [gate; up] (a LoRA B), -> gate_up_proj's order, gate and up in turn."""
    gate, up = fc1_rows.chunk(2)
    return _interleaved(gate.t(), up.t()).t()
