"""Megatron-LM's ``torch_dist`` checkpoints: ``torch.distributed.checkpoint`` files, read without Megatron.

    iter_0001000/.metadata          pickled torch.distributed.checkpoint Metadata: every tensor's
                                    global shape, its chunks and where each chunk's bytes are
    iter_0001000/__0_0.distcp ...   the bytes (each chunk a torch.save'd tensor)
    iter_0001000/common.pt          args, iteration, ... (up to Megatron-Core 0.18; later inside the .distcp)
    iter_0001000/metadata.json      {"sharded_backend": "torch_dist", ...}

Keys are global and unsharded (each ``.distcp`` holds chunks of them): the layers are
stacked into one tensor per name with a leading layer dimension
(``decoder.layers.mlp.linear_fc1.weight`` of shape [layers, ...]) and the norms carry
Transformer Engine's names (``linear_qkv.layer_norm_weight``) even with local layers. The
``.metadata`` pickle is read with the restricted unpickler, allowing only the
metadata classes of ``torch.distributed.checkpoint``, and each chunk with
``torch.load(weights_only=True)``: nothing in the files can run code.
"""
from __future__ import annotations

import io
import os
import re

import torch

from megatron_lite.checkpointing.megatron.safe_unpickle import (load_pickle_file, load_torch_file,
                                                                restricted_pickle_module)
from megatron_lite.checkpointing.storage import CheckpointError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
_STACKED = re.compile(r"^decoder\.layers\.(?!\d)(.+)$")


def _metadata_classes() -> dict:
    """What the .metadata pickle may name: torch.distributed.checkpoint's metadata and save-plan classes (plain
    dataclasses and enums) and the function that turns a layout's name into torch.strided.

    torch.distributed.checkpoint is imported here, when a torch_dist checkpoint is read, not with this module:
    it brings DTensor and sympy, a second or more of every command's start-up (the command line imports this
    module to recognise a Megatron-LM --load)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    return {
        **{("torch.distributed.checkpoint.metadata", name): getattr(metadata, name) for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
        **{("torch.distributed.checkpoint.planner", name): getattr(planner, name) for name in (
            "SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")},
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    }


def is_torch_dist(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def _read_bytes(directory: str, info) -> bytes:
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _common_state(directory: str, storage: dict) -> dict:
    """``common.pt`` (core <= 0.18), else the ``common`` bytes item stored in the .distcp files."""
    path = os.path.join(directory, COMMON_FILE)
    if os.path.isfile(path):
        return load_torch_file(path)
    for index, info in storage.items():
        if index.fqn == "common" or index.fqn.endswith(".common"):
            return torch.load(io.BytesIO(_read_bytes(directory, info)), weights_only=False, map_location="cpu",
                              pickle_module=restricted_pickle_module(directory))
    raise CheckpointError(f"{directory} has no common.pt nor a 'common' entry: Megatron's args are missing.")


def read(directory: str) -> tuple:
    """(args, iteration, {Megatron name, layers numbered globally: global tensor}) of a torch_dist directory;
    byte entries (``_extra_state``) and the optimizer's and RNG's tensors are left out."""
    from torch.distributed.checkpoint import metadata

    meta = load_pickle_file(os.path.join(directory, METADATA_FILE), extra=_metadata_classes())
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
        tensors.update(_unstacked(name, full))
    return common["args"], common.get("iteration", 0), tensors


def _unstacked(name: str, tensor: torch.Tensor) -> dict:
    """A stacked ``decoder.layers.<name>`` [layers, ...] as one tensor per global layer."""
    match = _STACKED.match(name)
    if match is None:
        return {name: tensor}
    return {f"decoder.layers.{i}.{match.group(1)}": t for i, t in enumerate(tensor.unbind(0))}
