"""Global tensors and their shards: what a checkpoint records so any layout can load it.

A checkpoint names every tensor by its layout-independent global name and records
how the saving run split it:

    tensor parallel:   ``partition_dim`` and ``partition_stride`` (``shard_tensor``'s arguments)
                       and, for each shard, the tensor-parallel rank and size that held it
    data parallel:     distributed-optimizer state is a ``flat_range`` [start, end) of the
                       flattened tensor-parallel shard (a rank owns a slice of the flat buffer)
    vocabulary:        embedding rows past ``vocab_size`` are padding whose count depends on
                       the tensor-parallel size (``ModelConfig.padded_vocab_size``)

Loading rebuilds the global tensor from the shards (``read_global``), resizes the
vocabulary padding if the new layout pads differently, and cuts the loading
rank's own shard (``local_shard``). Pipeline stages need nothing: a stage simply
asks for the names it holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_lite.checkpointing.storage import CheckpointError, TensorFileReader, read_metadata, verify_files
from megatron_lite.model.weight_init import full_shape
from megatron_lite.tensor_parallel import gather_shards, shard_tensor

# Parameters whose dim 0 is the (padded) vocabulary.
_VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def has_vocab_rows(name: str) -> bool:
    return name.endswith(_VOCAB_PARAMETERS)


@dataclass
class ShardedTensor:
    """One rank's piece of a global tensor, and where that piece sits in it.

    Attributes:
        key: global name ("decoder.layers.3.mlp.linear_fc1.weight", "optimizer.exp_avg.<param>").
        data: the piece: the tensor-parallel shard, or a 1-D slice of it when ``flat_range`` is set.
        global_shape: shape of the whole tensor.
        partition_dim, partition_stride: how tensor parallelism splits it (None: replicated).
        tp_rank, tp_size: which tensor-parallel shard ``data`` is (0 and 1 when replicated).
        flat_range: (start, end) of the flattened shard held in ``data`` (distributed optimizer).
        vocab_size: unpadded vocabulary when dim 0 is the padded vocabulary, else None.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple
    partition_dim: Optional[int] = None
    partition_stride: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    flat_range: Optional[tuple] = None
    vocab_size: Optional[int] = None

    @classmethod
    def of_parameter(cls, key: str, data: torch.Tensor, param: torch.Tensor, *, tp_rank: int, tp_size: int,
                     vocab_size: Optional[int], flat_range: Optional[tuple] = None,
                     local_shape: Optional[tuple] = None) -> "ShardedTensor":
        """``data`` is ``param``'s local value (or a flat slice of it); the split comes from the
        attributes the tensor-parallel layers set on ``param``, its shape from ``local_shape`` when
        given (a ZeRO-3 parameter is empty between uses)."""
        shape = full_shape(param, tp_size, local_shape)
        if getattr(param, "tensor_model_parallel", False):
            return cls(key, data, tuple(shape), param.partition_dim, param.partition_stride, tp_rank, tp_size,
                       flat_range, vocab_size)
        return cls(key, data, tuple(shape), flat_range=flat_range, vocab_size=vocab_size)

    def index_entry(self) -> dict:
        """The tensor's description in the metadata (identical on every rank holding a piece)."""
        return {"global_shape": list(self.global_shape), "dtype": str(self.data.dtype).removeprefix("torch."),
                "partition_dim": self.partition_dim, "partition_stride": self.partition_stride,
                "vocab_size": self.vocab_size, "shards": []}

    def shard_entry(self, file_name: str) -> dict:
        return {"file": file_name, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "flat_range": None if self.flat_range is None else list(self.flat_range)}


def index_of(pieces: list[ShardedTensor], file_name: str) -> dict:
    """The metadata's tensor index for ``pieces`` stored in ``file_name`` under their keys."""
    index: dict = {}
    for piece in pieces:
        merge_index(index, {piece.key: {**piece.index_entry(), "shards": [piece.shard_entry(file_name)]}})
    return index


def merge_index(into: dict, index: dict) -> None:
    """Add another file's tensor index; every piece of a tensor must describe the same global tensor."""
    for key, entry in index.items():
        merged = into.setdefault(key, {**entry, "shards": []})
        if {k: v for k, v in merged.items() if k != "shards"} != {k: v for k, v in entry.items() if k != "shards"}:
            raise CheckpointError(f"ranks disagree on the shape or split of {key!r}: {merged} vs {entry}.")
        merged["shards"] = merged["shards"] + entry["shards"]


def _local_shape(entry: dict, tp_size: int) -> list:
    shape = list(entry["global_shape"])
    if entry["partition_dim"] is not None:
        shape[entry["partition_dim"]] //= tp_size
    return shape


def read_global(key: str, entry: dict, read: Callable[[str, str], torch.Tensor]) -> torch.Tensor:
    """The whole tensor ``key`` from its shards; ``read(file, key)`` returns a stored piece."""
    by_tp_rank: dict = {}
    for shard in entry["shards"]:
        by_tp_rank.setdefault(shard["tp_rank"], []).append(shard)
    tp_size = entry["shards"][0]["tp_size"] if entry["shards"] else 0
    if sorted(by_tp_rank) != list(range(tp_size)):
        raise CheckpointError(f"checkpoint holds tensor-parallel shards {sorted(by_tp_rank)} of {key!r}, "
                              f"expected 0..{tp_size - 1}: the checkpoint is incomplete.")
    local_shape = _local_shape(entry, tp_size)
    shards = [_assemble_flat(key, by_tp_rank[r], local_shape, read) for r in range(tp_size)]
    if entry["partition_dim"] is None:
        return shards[0]
    return gather_shards(shards, partition_dim=entry["partition_dim"], partition_stride=entry["partition_stride"])


def _assemble_flat(key: str, pieces: list, local_shape: list, read) -> torch.Tensor:
    """One tensor-parallel shard, from one stored tensor or from data-parallel flat slices."""
    numel = math.prod(local_shape)
    if pieces[0]["flat_range"] is None:
        return _read_piece(read, pieces[0]["file"], key, numel).reshape(local_shape)
    pieces = sorted(pieces, key=lambda p: p["flat_range"][0])
    ranges = [tuple(p["flat_range"]) for p in pieces]
    if ranges[0][0] != 0 or ranges[-1][1] != numel or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise CheckpointError(f"the data-parallel slices of {key!r} cover {ranges}, not 0:{numel} exactly once: "
                              f"the checkpoint is incomplete.")
    return torch.cat([_read_piece(read, p["file"], key, end - start).reshape(-1)
                      for p, (start, end) in zip(pieces, ranges)]).reshape(local_shape)


def _read_piece(read, file_name: str, key: str, numel: int) -> torch.Tensor:
    """A stored piece, which must have the size the metadata gives it (an edited shape must not reach reshape)."""
    piece = read(file_name, key)
    if piece.numel() != numel:
        raise CheckpointError(f"{file_name} holds {key!r} with {piece.numel()} elements (shape {list(piece.shape)}), "
                              f"but metadata.json gives that piece {numel}: the metadata was edited or is corrupt.")
    return piece


def resize_vocab(full: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Cut or zero-pad the padding rows so dim 0 has ``padded_vocab_size`` rows (real rows untouched)."""
    rows = full.shape[0]
    if rows >= padded_vocab_size:
        return full[:padded_vocab_size]
    padding = full.new_zeros((padded_vocab_size - rows, *full.shape[1:]))
    return torch.cat([full, padding])


def local_shard(key: str, entry: dict, full: torch.Tensor, param: torch.Tensor, *, tp_rank: int,
                tp_size: int, local_shape: Optional[tuple] = None) -> torch.Tensor:
    """This rank's shard of ``full`` for ``param`` (whose attributes say how it is split here, and whose
    shape is ``local_shape`` when given: a ZeRO-3 parameter is empty between uses)."""
    target = list(full_shape(param, tp_size, local_shape))
    parallel = getattr(param, "tensor_model_parallel", False)
    if entry["vocab_size"] is not None and list(full.shape[1:]) == target[1:]:
        full = resize_vocab(full, target[0])
    if list(full.shape) != target:
        raise CheckpointError(f"{key!r} has shape {list(full.shape)} in the checkpoint but {target} in this model: "
                              f"the model configuration differs from the checkpoint's.")
    if not parallel:
        return full
    return shard_tensor(full, partition_dim=param.partition_dim, partition_stride=param.partition_stride,
                        rank=tp_rank, world_size=tp_size)


class CheckpointReader:
    """A checkpoint directory as global tensors by name, whichever layout wrote it."""

    def __init__(self, directory: str):
        self.directory = directory
        self.metadata = read_metadata(directory)
        self.tensors: dict = self.metadata["tensors"]
        self._files = TensorFileReader(directory)

    def entry(self, key: str) -> dict:
        if key not in self.tensors:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {key!r}: it was saved from a "
                                  f"different model (compare its metadata.json with this run's flags).")
        return self.tensors[key]

    def verify(self, keys, extra_files=()) -> None:
        """Sizes of every file, SHA-256 of the files holding ``keys`` and of ``extra_files``."""
        files = {shard["file"] for key in keys for shard in self.entry(key)["shards"]} | set(extra_files)
        verify_files(self.directory, self.metadata, checksum=files)

    def read(self, key: str) -> torch.Tensor:
        return read_global(key, self.entry(key), self._files.get)

    def stored_names(self, file_name: str) -> list:
        return self._files.names(file_name)

    def read_stored(self, file_name: str, name: str) -> torch.Tensor:
        return self._files.get(file_name, name)
