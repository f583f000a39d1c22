"""Megatron-LM's ``torch_dist`` checkpoints (docs/reference.md, section 13), read and written without Megatron.

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

Writing (``write``) lays out what Megatron-Core's ``save_checkpoint`` writes: each global
rank's chunks in ``__{rank}_0.distcp``, written by ``torch.distributed.checkpoint``'s own
``FileSystemWriter`` (one save plan per rank, as its collective save would make them), the
``.metadata`` listing every tensor's chunks, ``metadata.json``, and the common state in
``common.pt`` (read by every core version) or, as core 0.19 and later write it, as the
``common_state`` object inside rank 0's ``.distcp``.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import re
from typing import Optional

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from megatron_lite.checkpointing.megatron.safe_unpickle import (load_pickle_file, load_torch_file,
                                                                restricted_pickle_module)
from megatron_lite.checkpointing.storage import CheckpointError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"
# Where the common state (args, iteration...) goes: its own file (core <= 0.18), or inside the .distcp (>= 0.19).
COMMON_STATE_LAYOUTS = ("common.pt", "distcp")
COMMON_STATE_KEY = "common_state"
# What the .metadata pickle may name: torch.distributed.checkpoint's metadata and save-plan classes (plain
# dataclasses and enums) and the function that turns a layout's name into torch.strided.
_METADATA_CLASSES = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    **{("torch.distributed.checkpoint.planner", name): getattr(planner, name) for name in (
        "SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # a StorageMeta's checkpoint_id, as torch's own writer records it
}
_STACKED = re.compile(r"^decoder\.layers\.(?!\d)(.+)$")


def is_torch_dist(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def _read_bytes(directory: str, info) -> bytes:
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def read_metadata(directory: str) -> metadata.Metadata:
    """The ``.metadata`` of a torch_dist directory, read with the restricted unpickler."""
    return load_pickle_file(os.path.join(directory, METADATA_FILE), extra=_METADATA_CLASSES)


def read_common_state(directory: str) -> dict:
    """The common state (args, iteration, ...) of a torch_dist directory, in either layout."""
    return _common_state(directory, read_metadata(directory).storage_data)


def _common_state(directory: str, storage: dict) -> dict:
    """``common.pt`` (core <= 0.18), else the ``common_state`` bytes item stored in the .distcp files."""
    path = os.path.join(directory, COMMON_FILE)
    if os.path.isfile(path):
        return load_torch_file(path)
    for index, info in storage.items():
        if index.fqn == ShardedObject(COMMON_STATE_KEY).unique_key:  # a list of the replicas written: one
            (common,) = torch.load(io.BytesIO(_read_bytes(directory, info)), weights_only=False, map_location="cpu",
                                   pickle_module=restricted_pickle_module(directory))
            return common
    raise CheckpointError(f"{directory} has no common.pt nor a '{COMMON_STATE_KEY}' entry: Megatron's args are "
                          f"missing.")


def read(directory: str) -> tuple:
    """(args, iteration, {Megatron name, layers numbered globally: global tensor}) of a torch_dist directory;
    byte entries (``_extra_state``) and the optimizer's and RNG's tensors are left out."""
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
        tensors.update(_unstacked(name, full))
    return common["args"], common.get("iteration", 0), tensors


def _unstacked(name: str, tensor: torch.Tensor) -> dict:
    """A stacked ``decoder.layers.<name>`` [layers, ...] as one tensor per global layer."""
    match = _STACKED.match(name)
    if match is None:
        return {name: tensor}
    return {f"decoder.layers.{i}.{match.group(1)}": t for i, t in enumerate(tensor.unbind(0))}


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A rank's piece of a global tensor: Megatron-Core's key, the global shape, where the piece starts."""

    key: str
    global_shape: tuple
    offsets: tuple
    tensor: torch.Tensor

    def write_item(self) -> planner.WriteItem:
        properties = metadata.TensorProperties(dtype=self.tensor.dtype)
        chunk = metadata.ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.tensor.shape)
        return planner.WriteItem(index=metadata.MetadataIndex(self.key, torch.Size(self.offsets)),
                                 type=planner.WriteItemType.SHARD,
                                 tensor_data=planner.TensorWriteData(chunk, properties, torch.Size(self.global_shape)))

    def data(self):
        return self.tensor.detach().clone().contiguous()  # torch.save of a view would save its whole storage


@dataclasses.dataclass(frozen=True)
class ShardedObject:
    """A pickled object stored as bytes under ``key/shard_{offset}_{shape}`` (Megatron-Core's ShardedObject):
    a layer's ``_extra_state``, the common state."""

    key: str
    offset: tuple = (0,)
    shape: tuple = (1,)
    value: object = None

    @property
    def unique_key(self) -> str:
        return f"{self.key}/shard_{'.'.join(map(str, self.offset))}_{'.'.join(map(str, self.shape))}"

    def write_item(self) -> planner.WriteItem:
        return planner.WriteItem(index=metadata.MetadataIndex(self.unique_key), type=planner.WriteItemType.BYTE_IO)

    def data(self) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save([self.value], buffer)  # Megatron-Core saves the list of a key's replicas on this rank
        return buffer


class _Writer(filesystem.FileSystemWriter):
    """torch's writer, recording the checkpoint's directory as a string, as Megatron-Core's writer does."""

    def storage_meta(self) -> metadata.StorageMeta:
        return metadata.StorageMeta(checkpoint_id=str(self.checkpoint_id), save_id=self.save_id)


class _Resolver:
    """What ``FileSystemWriter.write_data`` asks of its planner: the data of each write item."""

    def __init__(self, items: list):
        self.items = {item.write_item().index: item for item in items}

    def resolve_data(self, write_item: planner.WriteItem):
        return self.items[write_item.index].data()


def write(directory: str, ranks: list, common: dict, *, common_state: str = "common.pt") -> None:
    """Write a torch_dist directory: ``ranks[r]`` is global rank r's list of ``Chunk``/``ShardedObject``;
    ``common`` the common state (args, iteration, ...), laid out as ``common_state`` says."""
    if common_state not in COMMON_STATE_LAYOUTS:
        raise ValueError(f"common_state must be one of {COMMON_STATE_LAYOUTS}, got {common_state!r}")
    os.makedirs(directory, exist_ok=True)
    ranks = [list(items) for items in ranks]
    if common_state == "distcp":
        ranks[0].append(ShardedObject(COMMON_STATE_KEY, value=common))
    else:
        torch.save(common, os.path.join(directory, COMMON_FILE))
    writer = _Writer(directory, thread_count=1)
    writer.set_up_storage_writer(True)
    plans = writer.prepare_global_plan([planner.SavePlan([item.write_item() for item in items]) for items in ranks])
    results = [writer.write_data(plan, _Resolver(items)).wait() for plan, items in zip(plans, ranks)]
    writer.finish(metadata.Metadata(_state_dict_metadata(ranks)), results)
    config = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    if common_state == "common.pt":  # core <= 0.18 also names the common file's backend
        config.update(common_backend="torch", common_backend_version=1)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f)


def _state_dict_metadata(ranks: list) -> dict:
    """Every key's global metadata: a tensor's shape, dtype and chunks (rank by rank), or bytes."""
    entries: dict = {}
    for items in ranks:
        for item in items:
            if isinstance(item, ShardedObject):
                entries[item.unique_key] = metadata.BytesStorageMetadata()
                continue
            entry: Optional[metadata.TensorStorageMetadata] = entries.get(item.key)
            if entry is None:
                entry = entries[item.key] = metadata.TensorStorageMetadata(
                    metadata.TensorProperties(dtype=item.tensor.dtype), torch.Size(item.global_shape), [])
            entry.chunks.append(item.write_item().tensor_data.chunk)
    return entries
