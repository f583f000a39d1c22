"""Megatron-LM's memory-mapped indexed dataset (``MMIDIDX``): a ``.bin`` of tokens and an ``.idx`` index.

``.bin`` holds every sequence's tokens back to back with no header. ``.idx`` (little-endian):
magic (9 bytes), version (uint64 = 1), dtype code (uint8), sequence count N (uint64),
document-index length D (uint64), then int32 lengths[N], int64 byte pointers[N] into ``.bin``
and int64 document indices[D] (document k = sequences doc[k]..doc[k+1]). Files written here
open in Megatron-LM and vice versa.
"""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np

from megatron_lite.config import UserError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # = 34
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(UserError, ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated, corrupt, or the two files do not belong together."""


def data_file_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming of a preprocessed JSON key: ``{output_prefix}_{key}_document`` (what --data-path takes)."""
    return f"{output_prefix}_{key}_document"


def best_fitting_dtype(vocab_size: int) -> type:
    """uint16 halves the file size when every id fits (Megatron's threshold); int32 otherwise."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetBuilder:
    """Streams sequences into ``.bin`` and writes ``.idx`` in ``finalize``.

    Both files are written under temporary names and renamed only when complete (``.idx``
    last), so an interrupted run never leaves a pair that looks valid. Use as a context
    manager, or call ``abort`` on failure, to remove the temporaries.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of {sorted(map(str, _CODE_OF_DTYPE))}.")
        self._bin_path = bin_path
        self._temporary_bin = f"{bin_path}.tmp-{os.getpid()}"
        self._temporary_idx = None
        self._bin = open(self._temporary_bin, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Appends one sequence (ids must fit the dtype: a uint16 file cannot hold id 70000)."""
        array = np.asarray(tokens)
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"token ids span [{array.min()}, {array.max()}], outside {self.dtype}'s "
                                 f"[{info.min}, {info.max}]; build with a wider dtype (int32).")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens) -> None:
        """One sequence that is also one document (no sentence splitting).

        An empty document adds no sequence but still ends a document (its two document indices
        are equal), as Megatron-LM's builder records a document whose sentences are all empty.
        """
        if np.asarray(tokens).size:
            self.add_item(tokens)
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Appends a whole existing dataset (same dtype), keeping its document boundaries."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{path_prefix} holds {other.dtype} tokens but this output is {self.dtype}; "
                                      "merge datasets built with tokenizers of the same vocabulary size class.")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((offset + other.document_indices[1:]).tolist())
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin)

    def finalize(self, idx_path: str) -> None:
        """Writes the index and renames both files into place."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {lengths.max()} tokens does not fit the index's int32 lengths.")
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()  # close a trailing document so the last index entry is N
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        self._temporary_idx = f"{idx_path}.tmp-{os.getpid()}"
        with open(self._temporary_idx, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", _CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.asarray(self.document_indices, dtype="<i8").tobytes())
        # A stale .idx next to the new .bin would look like a pair; remove it before the .bin lands.
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._temporary_bin, self._bin_path)
        os.replace(self._temporary_idx, idx_path)

    def abort(self) -> None:
        """Closes and deletes the temporary files (the real output names are never touched)."""
        self._bin.close()
        for path in (self._temporary_bin, self._temporary_idx):
            if path and os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self.abort()


class IndexedDataset:
    """Read-only view of ``{path_prefix}.bin``/``.idx``, validated on open.

    ``dataset[i]`` is sequence i's tokens; ``get(i, offset, length)`` reads part of one. The
    ``.bin`` is memory-mapped, or with ``mmap=False`` (``--no-mmap-bin-files``) read with one
    file read per call, as Megatron-LM does for filesystems where mapping large files is slow.
    """

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = path_prefix
        self.mmap = mmap
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path} does not exist. --data-path takes the prefix without .bin/.idx (for example "
                    f"my-corpus_text_document), as written by tools/preprocess_data.py.")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        idx_size = os.path.getsize(idx_path)
        if not (header.startswith(INDEX_MAGIC) or INDEX_MAGIC.startswith(header)):
            raise IndexedDatasetError(f"{idx_path} is not a Megatron indexed-dataset index (magic "
                                      f"{header[:len(INDEX_MAGIC)]!r}, expected {INDEX_MAGIC!r}).")
        if len(header) < HEADER_SIZE:
            raise IndexedDatasetError(f"{idx_path} is truncated: {idx_size} bytes, shorter than the "
                                      f"{HEADER_SIZE}-byte header. Rerun tools/preprocess_data.py.")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{idx_path} has index version {version}; only version {INDEX_VERSION} "
                                      "is supported.")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path} has unknown dtype code {code} (valid: 1-8); the file is corrupt.")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected_idx_size = HEADER_SIZE + 12 * count + 8 * doc_count
        if idx_size != expected_idx_size:
            raise IndexedDatasetError(
                f"{idx_path} is {idx_size} bytes but its header ({count} sequences, {doc_count} document "
                f"indices) needs {expected_idx_size}: the index is truncated or corrupt. "
                "Rerun tools/preprocess_data.py.")

        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=count, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=count, offset=HEADER_SIZE + 4 * count)
        self.document_indices = np.frombuffer(index, dtype="<i8", count=doc_count, offset=HEADER_SIZE + 12 * count)
        self._check_index(idx_path)

        expected_bin_size = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != expected_bin_size:
            raise IndexedDatasetError(
                f"{bin_path} is {bin_size} bytes but {idx_path} describes {expected_bin_size} "
                f"({self.sequence_lengths.sum(dtype=np.int64)} tokens x {self.dtype.itemsize} bytes): the .bin is "
                "truncated or the pair does not belong together. Rerun tools/preprocess_data.py.")
        self._bin_path, self._num_tokens = bin_path, bin_size // self.dtype.itemsize
        self._tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size and mmap
                        else np.empty(0, dtype=self.dtype))

    def _check_index(self, idx_path: str) -> None:
        lengths, pointers, documents = self.sequence_lengths, self.sequence_pointers, self.document_indices
        corrupt = None
        if lengths.size and lengths.min() < 0:
            corrupt = "a negative sequence length"
        elif lengths.size and (pointers[0] != 0 or np.any(np.diff(pointers) != lengths[:-1].astype(np.int64)
                                                           * self.dtype.itemsize)):
            corrupt = "sequence pointers that do not follow the lengths"
        elif (documents.size == 0 or documents[0] != 0 or documents[-1] != len(lengths)
              or np.any(np.diff(documents) < 0)):
            corrupt = "document indices that are not 0 = d0 <= d1 <= ... = sequence count"
        if corrupt:
            raise IndexedDatasetError(f"{idx_path} is corrupt: it has {corrupt}. Rerun tools/preprocess_data.py.")

    def all_tokens(self) -> np.ndarray:
        """Every token of the .bin, memory-mapped whatever ``mmap`` says: for one pass over the whole file."""
        if not self._num_tokens:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self._bin_path, dtype=self.dtype, mode="r")

    def __reduce__(self):
        # Loader workers reopen the memory map instead of receiving a pickled copy of the tokens.
        return IndexedDataset, (self.path_prefix, self.mmap)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence ``index`` (to its end when length is None)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences in {self.path_prefix}")
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        if self.mmap:
            return self._tokens[start:start + length]
        count = max(0, min(length, self._num_tokens - start))  # clipped at the file's end, as the slice is
        return np.fromfile(self._bin_path, dtype=self.dtype, count=count, offset=start * self.dtype.itemsize)
