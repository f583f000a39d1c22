"""How Megatron-LM names and splits a GPT's tensors, as megatron_lite's names.

Megatron-Core names (``decoder.layers.3.self_attention.linear_qkv.weight``) are ours
but for three things: the final norm (``decoder.final_layernorm`` here, ``final_layernorm``
in ours), Transformer Engine's fused norms (the norm before a linear is stored inside
it: ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), and the older
model of ``--use-legacy-models``, whose state dict nests
``language_model.{embedding,encoder,output_layer}`` and names layers after the GPT-2
paper (``query_key_value``, ``dense_h_to_4h``...). Files of one pipeline stage number
their layers from 0.

Multi-token prediction's depths (``--mtp-num-layers``, on the last stage) are ``mtp.layers.D.``: ``enorm``,
``hnorm``, ``eh_proj`` and ``final_layernorm`` as ours, and a transformer layer, ``mtp_model_layer.`` in the
legacy files of core 0.17 and later (ours), ``transformer_layer.`` in core 0.16's and in every torch_dist (where
Megatron-Core keeps the older name), named inside as a decoder layer is.

The splits are ours too (Megatron's column-parallel layers split dim 0 and row-parallel
layers dim 1; the fused QKV holds whole query groups ``[q heads of the group; k; v]``
per rank, SwiGLU's fc1 ``[gate_r; up_r]`` per rank), so one tensor-parallel rank's
shards are cut and joined with our model's own ``partition_dim``/``partition_stride``.
"""
from __future__ import annotations

import re
from typing import Optional

# (Megatron's name inside a layer, ours): Transformer Engine's norm names (torch_dist uses them for local
# layers too), then the legacy model's layer names.
TE_NORM_RENAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)
# Megatron-Core's names inside a layer that are not ours: the sinks (--softmax-type learnable) are its core
# attention's.
MCORE_LAYER_RENAMES = (("self_attention.core_attention.softmax_offset", "self_attention.softmax_offset"),)
LAYER_RENAMES = (
    *TE_NORM_RENAMES,
    *MCORE_LAYER_RENAMES,
    ("input_norm.", "input_layernorm."),
    ("post_attention_norm.", "pre_mlp_layernorm."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."),
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
    ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
)
# Outside the layers: Megatron-Core's names -> ours (the export writes them back), then the legacy model's.
MCORE_TOP_RENAMES = {
    "decoder.final_layernorm.weight": "final_layernorm.weight",
    "decoder.final_layernorm.bias": "final_layernorm.bias",
}
TOP_RENAMES = {
    **MCORE_TOP_RENAMES,
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.encoder.final_norm.weight": "final_layernorm.weight",
    "language_model.encoder.final_norm.bias": "final_layernorm.bias",
    "language_model.encoder.final_layernorm.weight": "final_layernorm.weight",
    "language_model.encoder.final_layernorm.bias": "final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.weight",
}
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"^(?:decoder|language_model\.encoder|language_model\.transformer)\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(?:mtp_model_layer|transformer_layer)\.(.+)$")
TIED_OUTPUT_COPIES = ("output_layer.weight", "word_embeddings_for_head.weight")


def flatten(state: dict, prefix: str = "") -> dict:
    """The legacy model's nested state dict as dotted names (a flat one is returned as it is)."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def local_layer(name: str) -> Optional[tuple[int, str]]:
    """(layer number in its file, our name inside the layer) for a layer tensor, else None."""
    match = _LAYER.match(name)
    if match is None:
        return None
    return int(match.group(1)), _ours_inside_layer(match.group(2))


def _ours_inside_layer(inner: str) -> str:
    for theirs, ours in LAYER_RENAMES:
        if inner.startswith(theirs):
            return ours + inner[len(theirs):]
    return inner


def is_ignored(name: str, *, tied: bool) -> bool:
    """Tensors that are not weights (``_extra_state``: Transformer Engine's FP8 metadata) and the last
    pipeline stage's copy of tied embeddings."""
    return name.endswith("_extra_state") or (tied and name in TIED_OUTPUT_COPIES)


def ours_from_megatron(name: str, layer_offset: int) -> str:
    """Our global name for Megatron's ``name`` in a file whose first layer is global layer ``layer_offset``."""
    layer = local_layer(name)
    if layer is not None:
        return f"decoder.layers.{layer[0] + layer_offset}.{layer[1]}"
    mtp = _MTP_LAYER.match(name)
    if mtp is not None:
        return f"mtp.layers.{mtp.group(1)}.mtp_model_layer.{_ours_inside_layer(mtp.group(2))}"
    return TOP_RENAMES.get(name, name)


_MCORE_FROM_OURS = {ours: theirs for theirs, ours in MCORE_TOP_RENAMES.items()}


def megatron_from_ours(name: str, layer_offset: int) -> str:
    """Megatron-Core's local-layer name for our global ``name`` in the file of the pipeline stage whose
    first layer is global layer ``layer_offset`` (the inverse of ``ours_from_megatron`` for that model)."""
    layer, mtp = local_layer(name), _MTP_LAYER.match(name)
    if layer is not None:
        return f"decoder.layers.{layer[0] - layer_offset}.{_mcore_inside_layer(layer[1])}"
    if mtp is not None:
        return f"mtp.layers.{mtp.group(1)}.mtp_model_layer.{_mcore_inside_layer(mtp.group(2))}"
    return _MCORE_FROM_OURS.get(name, name)


def _mcore_inside_layer(inner: str) -> str:
    return next((theirs for theirs, ours in MCORE_LAYER_RENAMES if inner == ours), inner)


# Inside a layer, in torch_dist: Transformer Engine's norm names, and Megatron-Core's where they differ from ours.
_MCORE_INSIDE_LAYER = {ours: theirs for theirs, ours in (*TE_NORM_RENAMES, *MCORE_LAYER_RENAMES)}


def torch_dist_key(name: str, *, layers_stacked: bool = True) -> tuple[str, tuple]:
    """Megatron-Core's torch_dist key for our global ``name`` and where the tensor sits along the key's leading
    stacked dimensions, as (dimension, position) pairs: () outside the layers; (("layers", layer),) for a decoder
    layer's tensor when its layers are ``layers_stacked`` under one key; (..., ("experts", expert)) for an
    expert's (``mlp.experts.experts.<name>``, [(layers,) experts, ...]).

    A model whose layers differ (--moe-layer-freq other than 1) has a key per decoder layer instead
    (``decoder.layers.<layer>.<name>``), as a multi-token prediction layer's tensors always have
    (``mtp.layers.D.transformer_layer.<name>``)."""
    layer, mtp = local_layer(name), _MTP_LAYER.match(name)
    if layer is None and mtp is None:
        return _MCORE_FROM_OURS.get(name, name), ()
    if mtp is not None:
        prefix, inner, where = f"mtp.layers.{mtp.group(1)}.transformer_layer.", mtp.group(2), ()
    elif layers_stacked:
        prefix, inner, where = "decoder.layers.", layer[1], (("layers", layer[0]),)
    else:
        prefix, inner, where = f"decoder.layers.{layer[0]}.", layer[1], ()
    expert = expert_number(name)
    if expert is not None:
        inner = _LOCAL_EXPERT.sub(".mlp.experts.experts.", f".{inner}", count=1).removeprefix(".")
        return prefix + inner, (*where, ("experts", expert))
    return prefix + _MCORE_INSIDE_LAYER.get(inner, inner), where


def expert_number(name: str) -> Optional[int]:
    """The expert an expert tensor belongs to (``mlp.experts.local_experts.N.``), None for any other tensor."""
    match = _LOCAL_EXPERT.search(name)
    return None if match is None else int(match.group(1))


_GROUPED_MLP = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")
_TE_GROUPED_LINEAR = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")


def as_sequential_mlp(name: str, tensor, *, local_experts: int, hidden_size: int) -> list:
    """[(name, tensor)] of a legacy file's tensor with grouped-GEMM experts in the SequentialMLP layout
    (``mlp.experts.local_experts.N.linear_fc1.weight``, [out/tp, in] per expert); any other tensor as it is.

    --moe-grouped-gemm stores a rank's experts in one of two ways. Megatron-Core's legacy GroupedMLP (local
    layers) keeps ``weight1`` [hidden, experts x fc1 out/tp] and ``weight2`` [experts x ffn/tp, hidden], which its
    grouped GEMM reads as ``weight1.view(experts, hidden, -1)``: expert i's block of the storage is its fc1
    weight transposed (its rows [gate_r; up_r] under SwiGLU, as SequentialMLP's), likewise ``weight2``.
    Transformer Engine's TEGroupedMLP keeps each expert's linear as ``linear_fc1.weight{i}``, as SequentialMLP's.
    """
    grouped = _GROUPED_MLP.match(name)
    if grouped is not None:
        prefix, which = grouped.groups()
        blocks = tensor.reshape(local_experts, hidden_size, -1) if which == "1" else \
            tensor.reshape(local_experts, -1, hidden_size)
        return [(f"{prefix}local_experts.{i}.linear_fc{which}.weight", block.t()) for i, block in enumerate(blocks)]
    te = _TE_GROUPED_LINEAR.match(name)
    if te is not None:
        prefix, linear, kind, expert = te.groups()
        return [(f"{prefix}local_experts.{expert}.{linear}.{kind}", tensor)]
    return [(name, tensor)]


def renumbered_expert(name: str, shift: int) -> str:
    """An expert tensor's name with its expert number moved by ``shift``: an expert-parallel rank's file
    numbers its experts from 0, ours by their global number (a rank's first is rank x experts per rank)."""
    match = _LOCAL_EXPERT.search(name)
    return name[:match.start(1)] + str(int(match.group(1)) + shift) + name[match.end(1):]
