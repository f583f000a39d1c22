"""The checkpoint on disk: safe file formats, durable atomic writes, and validation.

    SAVE/latest_checkpointed_iteration.txt    "100": the newest complete checkpoint
    SAVE/iter_0000100/metadata.json           layout, config, training state, every tensor's split
    SAVE/iter_0000100/rank_00003.safetensors  one rank's shards (weights, optimizer state, RNG)

Tensors are stored only as safetensors and everything else as JSON, so opening a
checkpoint never unpickles anything: a pickle can run arbitrary code, and a
checkpoint may come from someone else.

A save is atomic: ranks write into ``SAVE/.iter_0000100.tmp``, every file is
fsynced, the directory is renamed to ``iter_0000100`` and only then is the pointer
file replaced (``os.replace``). A crash at any moment leaves the pointer naming the
previous, complete checkpoint. The metadata records each file's size and SHA-256,
so a truncated or corrupted file is reported instead of silently loaded.

Reading checks what it reads: the metadata and the tracker against their schema
(``metadata_schema``), every file against its size and checksum, and every path against
symbolic links leading out of the checkpoint (``check_inside``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import safetensors
import safetensors.torch
import torch

from megatron_lite.checkpointing.metadata_schema import SchemaError, parse_metadata, parse_tracker
from megatron_lite.config import UserError

METADATA_FILE = "metadata.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or incompatible; the message says which and why."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    """Where a save is written before it is renamed into place (hidden, so it is never mistaken for one)."""
    return os.path.join(root, f".iter_{iteration:07d}.tmp")


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def rank_index_name(rank: int) -> str:
    """A rank's tensor index while a save is staged; rank 0 merges them into the metadata."""
    return f"rank_{rank:05d}.json"


# ---------------------------------------------------------------------------------------------
# Durable writes


def _fsync_dir(path: str) -> None:
    # A rename is durable only once the directory holding it is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: str, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_tensor_file(path: str, tensors: dict) -> dict:
    """Write ``tensors`` (name -> tensor) as safetensors; returns the file's size and SHA-256."""
    # Cloned: safetensors refuses tensors sharing memory, e.g. views of one flat parameter buffer.
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    return _write_bytes(path, safetensors.torch.save(tensors))


def write_json(path: str, obj) -> dict:
    return _write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def prepare_staging(root: str, iteration: int) -> str:
    """Create an empty staging directory (removing a crashed save's leftovers). Call on one rank."""
    os.makedirs(root, exist_ok=True)
    staging = staging_dir(root, iteration)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def commit(root: str, iteration: int) -> str:
    """Move a fully written staging directory into place, then point the tracker file at it.

    Call on one rank, after every rank's files are written and fsynced.
    """
    staging, final = staging_dir(root, iteration), checkpoint_dir(root, iteration)
    _fsync_dir(staging)
    if os.path.exists(final):  # saving the same iteration again: the new save replaces it
        stale = final + ".old"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        os.rename(staging, final)
        shutil.rmtree(stale)
    else:
        os.rename(staging, final)
    _fsync_dir(root)
    write_latest_iteration(root, iteration)
    return final


def write_latest_iteration(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER_FILE}.tmp")
    _write_bytes(tmp, f"{iteration}\n".encode())
    os.replace(tmp, os.path.join(root, TRACKER_FILE))  # atomic: readers see the old or the new number
    _fsync_dir(root)


# ---------------------------------------------------------------------------------------------
# Reading and validation


def check_inside(path: str, directory: str) -> None:
    """Refuse ``path`` when it resolves outside ``directory``: a symbolic link to another run's checkpoint
    (or part of one) would load it silently. A link that stays inside is a layout choice and is followed."""
    real, boundary = os.path.realpath(path), os.path.realpath(directory)
    if os.path.commonpath([real, boundary]) != boundary:
        raise CheckpointError(f"{path} is a symbolic link to {real}, outside the checkpoint directory {directory}: "
                              f"loading through it would load another checkpoint's files as this one's. Replace the "
                              f"link with a copy of its target, or point --load at the checkpoint it belongs to.")


def check_is_directory(path: str, what: str) -> None:
    """``path`` exists and is a directory; else a CheckpointError saying which, so a typo in a path reads as
    one (not as a directory that lacks a file). ``what``: the flag or role, e.g. "--load"."""
    if not os.path.exists(path):
        raise CheckpointError(f"{what} {path}: the directory does not exist. Check the path (a typo, or a job "
                              f"that has not written it yet).")
    if not os.path.isdir(path):
        raise CheckpointError(f"{what} {path} is a file, not a directory: give the directory that holds it.")


def read_latest_iteration(root: str) -> int | None:
    """The iteration the tracker file names, or None when ``root`` holds no checkpoint."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(root, METADATA_FILE)):  # a plausible slip, which would train from scratch
            parent = os.path.dirname(os.path.normpath(root)) or "."
            raise CheckpointError(f"{root} is one iteration's checkpoint directory (it holds {METADATA_FILE}), not "
                                  f"a checkpoint root: give its parent {parent} instead (the --save directory, whose "
                                  f"{TRACKER_FILE} names the iteration to load).")
        return None
    check_inside(path, root)
    with open(path, "rb") as f:
        text = f.read(4096).decode(errors="replace").strip()  # a few digits: more is not a tracker
    try:
        iteration = parse_tracker(text)
    except SchemaError as error:
        raise CheckpointError(f"{path} {error}; write the iteration of a complete iter_* directory into it.") from None
    if os.path.lexists(checkpoint_dir(root, iteration)):
        check_inside(checkpoint_dir(root, iteration), root)
    return iteration


def resolve_checkpoint_dir(path: str) -> str:
    """A checkpoint root (newest iteration, via the tracker file) or one ``iter_*`` directory -> that directory."""
    check_is_directory(path, "checkpoint")
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    iteration = read_latest_iteration(path)
    if iteration is None:
        raise CheckpointError(f"{path} is neither a checkpoint root (no {TRACKER_FILE}) nor a checkpoint "
                              f"directory (no {METADATA_FILE}).")
    return checkpoint_dir(path, iteration)


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory} has no {METADATA_FILE}: it is not a megatron_lite checkpoint, or its "
                              f"save did not finish. Point --load at a checkpoint root holding "
                              f"{TRACKER_FILE}, or fix that file to name a complete iteration.")
    check_inside(path, directory)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return parse_metadata(data.decode())
    except UnicodeDecodeError as error:
        problem = f"is not valid JSON ({error})"
    except SchemaError as error:
        problem = str(error)
    raise CheckpointError(f"{path}: {problem}. The checkpoint is corrupt or was edited: restore the file, or load "
                          f"an earlier iteration (edit {TRACKER_FILE}).")


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_files(directory: str, metadata: dict, *, checksum: set | frozenset = frozenset()) -> None:
    """Check that every file the metadata lists exists with its recorded size, and that the
    files named in ``checksum`` have their recorded SHA-256."""
    unlisted = sorted(set(checksum) - set(metadata["files"]))
    if unlisted:
        raise CheckpointError(f"checkpoint {directory} refers to files its metadata does not list: {unlisted}; "
                              f"the metadata is corrupt.")
    for name, entry in metadata["files"].items():
        if os.path.basename(name) != name or name.startswith("."):  # a forged metadata file must not reach outside
            raise CheckpointError(f"checkpoint {directory} lists the file {name!r}, which is not a plain file name "
                                  f"inside the checkpoint directory; refusing to read it.")
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            check_inside(path, directory)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing. Restore the file, "
                                  f"or load an earlier iteration (edit {TRACKER_FILE}).")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint {directory} is incomplete or corrupt: {name} has {size} bytes, "
                                  f"the metadata records {entry['size']}. Load an earlier iteration.")
        if name in checksum and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {directory} is corrupt: {name} does not match its SHA-256 in "
                                  f"{METADATA_FILE}. Load an earlier iteration.")


# Leading bytes of what torch.save and pickle write: zip archives and pickle protocol 2-5 headers.
_PICKLE_SIGNATURES = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


class TensorFileReader:
    """Reads named tensors from a checkpoint's safetensors files, opening each file once."""

    def __init__(self, directory: str):
        self.directory = directory
        self._handles: dict = {}
        self._names: dict = {}

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            self._handles[file_name] = open_safetensors(os.path.join(self.directory, file_name))
            self._names[file_name] = set(self._handles[file_name].keys())
        return self._handles[file_name]

    def get(self, file_name: str, tensor_name: str) -> torch.Tensor:
        handle = self._handle(file_name)
        if tensor_name not in self._names[file_name]:
            raise CheckpointError(f"{os.path.join(self.directory, METADATA_FILE)} places {tensor_name!r} in "
                                  f"{file_name}, which does not hold it: the metadata was edited or is corrupt.")
        return handle.get_tensor(tensor_name)

    def names(self, file_name: str) -> list:
        return list(self._handle(file_name).keys())


def open_safetensors(path: str):
    """``safe_open`` with a clear refusal for anything that is not safetensors (a pickle above all)."""
    with open(path, "rb") as f:
        head, size = f.read(9), os.fstat(f.fileno()).st_size
    # Safetensors starts with its JSON header's length (8 bytes, little-endian), then the header: a header of
    # 640 bytes (0x280) begins b"\x80\x02" as pickle protocol 2 does, and must not be taken for one.
    safetensors_header = head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= size
    if head.startswith(_PICKLE_SIGNATURES) and not safetensors_header:
        raise CheckpointError(f"{path} is a pickle (torch.save) file, not safetensors. Unpickling can run arbitrary "
                              f"code, so megatron_lite refuses to open it; re-save its tensors with safetensors.")
    try:
        return safetensors.safe_open(path, framework="pt")
    except Exception as error:  # safetensors raises its own error types for a malformed header
        raise CheckpointError(f"{path} is not a valid safetensors file ({error}); the checkpoint is corrupt.") from None
