"""Writing Megatron-LM's ``torch_dist`` checkpoints (docs/reference.md, section 13; reading: ``torch_dist``).

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
from typing import Optional

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from megatron_lite.interop.megatron.torch_dist import (COMMON_FILE, COMMON_STATE_KEY, COMMON_STATE_LAYOUTS,
                                                             CONFIG_FILE, sharded_object_key)


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
        return sharded_object_key(self.key, self.offset, self.shape)

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
