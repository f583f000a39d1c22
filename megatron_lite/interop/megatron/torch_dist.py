"""Megatron-LM's ``torch_dist`` checkpoints (docs/reference.md, section 13), read and written without Megatron.

    iter_0001000/.metadata          pickled torch.distributed.checkpoint Metadata: every tensor's
                                    global shape, its chunks and where each chunk's bytes are
    iter_0001000/__0_0.distcp ...   the bytes (each chunk a torch.save'd tensor)
    iter_0001000/common.pt          args, iteration, ... (up to Megatron-Core 0.18; later inside the .distcp)
    iter_0001000/metadata.json      {"sharded_backend": "torch_dist", ...}

Keys are global and unsharded (each ``.distcp`` holds chunks of them): the layers are
stacked into one tensor per name with a leading layer dimension
(``decoder.layers.mlp.linear_fc1.weight`` of shape [layers, ...]), a mixture of experts' expert
tensors with an expert dimension after it (``decoder.layers.mlp.experts.experts.linear_fc1.weight``
of shape [layers, experts, ...]); a model whose layers differ (--moe-layer-freq other than 1) and the
multi-token prediction layers have a key per layer instead, and the norms carry
Transformer Engine's names (``linear_qkv.layer_norm_weight``) even with local layers. The
``.metadata`` pickle is read with the restricted unpickler, allowing only the
metadata classes of ``torch.distributed.checkpoint``, and each chunk with
``torch.load(weights_only=True)``: nothing in the files can run code.

Writing is ``torch_dist_writer``'s, which alone imports ``torch.distributed.checkpoint`` at load time:
the command line imports this module to recognise a Megatron-LM ``--load``, and that package (DTensor,
sympy) costs a second or more of every command's start-up.
"""
from __future__ import annotations

import io
import os
import pathlib
import re

import torch

from megatron_lite.interop.megatron.safe_unpickle import (load_pickle_file, load_torch_file,
                                                                restricted_pickle_module)
from megatron_lite.checkpointing.storage import CheckpointError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"
# Where the common state (args, iteration...) goes: its own file (core <= 0.18), or inside the .distcp (>= 0.19).
COMMON_STATE_LAYOUTS = ("common.pt", "distcp")
COMMON_STATE_KEY = "common_state"
_STACKED = re.compile(r"^decoder\.layers\.(?!\d)(.+)$")
# The experts' tensors in torch_dist, [layers, experts, ...] under one key per name, whichever module wrote them
# (SequentialMLP, GroupedMLP and TEGroupedMLP write the same keys).
EXPERTS_KEY = "mlp.experts.experts."
# The experts of a layer keyed on its own, [experts, ...]: a decoder layer of a model whose layers differ
# (--moe-layer-freq other than 1: Megatron-Core's non-homogeneous layers), a multi-token prediction layer.
_LAYER_EXPERTS = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.)"
                            r"experts\.(.+)$")


def _metadata_classes() -> dict:
    """What the .metadata pickle may name: torch.distributed.checkpoint's metadata and save-plan classes (plain
    dataclasses and enums) and the function that turns a layout's name into torch.strided.

    torch.distributed.checkpoint is imported here, when a torch_dist checkpoint is read, not with this module
    (see the module's docstring)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    return {
        **{("torch.distributed.checkpoint.metadata", name): getattr(metadata, name) for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
        **{("torch.distributed.checkpoint.planner", name): getattr(planner, name) for name in (
            "SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")},
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,  # a StorageMeta's checkpoint_id, as torch's own writer records it
    }


def sharded_object_key(key: str, offset: tuple = (0,), shape: tuple = (1,)) -> str:
    """Where Megatron-Core stores a ShardedObject's bytes: ``key/shard_{offset}_{shape}``."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def is_torch_dist(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def _read_bytes(directory: str, info) -> bytes:
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def read_metadata(directory: str):
    """The ``.metadata`` (a torch.distributed.checkpoint ``Metadata``) of a torch_dist directory, read with the
    restricted unpickler."""
    return load_pickle_file(os.path.join(directory, METADATA_FILE), extra=_metadata_classes())


def read_common_state(directory: str) -> dict:
    """The common state (args, iteration, ...) of a torch_dist directory, in either layout."""
    return _common_state(directory, read_metadata(directory).storage_data)


def _common_state(directory: str, storage: dict) -> dict:
    """``common.pt`` (core <= 0.18), else the ``common_state`` bytes item stored in the .distcp files."""
    path = os.path.join(directory, COMMON_FILE)
    if os.path.isfile(path):
        return load_torch_file(path)
    for index, info in storage.items():
        if index.fqn == sharded_object_key(COMMON_STATE_KEY):  # a list of the replicas written: one
            (common,) = torch.load(io.BytesIO(_read_bytes(directory, info)), weights_only=False, map_location="cpu",
                                   pickle_module=restricted_pickle_module(directory))
            return common
    raise CheckpointError(f"{directory} has no common.pt nor a '{COMMON_STATE_KEY}' entry: Megatron's args are "
                          f"missing.")


def read(directory: str) -> tuple:
    """(args, iteration, {Megatron name, layers numbered globally: global tensor}) of a torch_dist directory;
    byte entries (``_extra_state``) and the optimizer's and RNG's tensors are left out."""
    from torch.distributed.checkpoint import metadata

    meta = read_metadata(directory)
    storage = meta.storage_data
    common = _common_state(directory, storage)
    if "args" not in common:
        raise CheckpointError(f"{directory}: the common state has no 'args'.")
    where = {(index.fqn, tuple(index.offset or ())): info for index, info in storage.items()}
    tensors = {}
    for fqn, item in meta.state_dict_metadata.items():
        name = fqn.removeprefix("model.")
        if not isinstance(item, metadata.TensorStorageMetadata) or name.startswith(("optimizer", "rng_state")):
            continue
        full = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for chunk in item.chunks:
            info = where[fqn, tuple(chunk.offsets)]
            piece = torch.load(io.BytesIO(_read_bytes(directory, info)), weights_only=True, map_location="cpu")
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            full[region] = piece
        tensors.update(_unstacked(name, full, {chunk.offsets[0] for chunk in item.chunks}))
    return common["args"], common.get("iteration", 0), tensors


def _unstacked(name: str, tensor: torch.Tensor, layers_held: set) -> dict:
    """A stacked ``decoder.layers.<name>`` [layers, ...] as one tensor per global layer that has chunks (where
    Megatron-Core before 0.10 stacked layers that differ, the dense and the expert layers each fill
    some layers of their keys), and the experts'
    ``mlp.experts.experts.<name>`` [layers, experts, ...] as one tensor per layer and expert, named as the
    legacy format names them (``mlp.experts.local_experts.<expert>.<name>``, the experts numbered globally);
    the experts [experts, ...] of a layer keyed on its own likewise."""
    match = _STACKED.match(name)
    if match is None:
        own = _LAYER_EXPERTS.match(name)
        if own is None:
            return {name: tensor}
        return {f"{own.group(1)}local_experts.{e}.{own.group(2)}": expert for e, expert in enumerate(tensor.unbind(0))}
    inner = match.group(1)
    layers = {i: t for i, t in enumerate(tensor.unbind(0)) if i in layers_held}
    if not inner.startswith(EXPERTS_KEY):
        return {f"decoder.layers.{i}.{inner}": t for i, t in layers.items()}
    rest = inner.removeprefix(EXPERTS_KEY)
    return {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest}": expert
            for i, t in layers.items() for e, expert in enumerate(t.unbind(0))}
