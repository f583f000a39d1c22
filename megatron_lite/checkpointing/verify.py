"""Checking a checkpoint directory without training (``tools/verify_checkpoint.py``).

A load checks what that rank reads: the metadata against its schema, every file's size, and the
SHA-256 of the files holding its own shards. Before a long job resumes from a checkpoint, or before
one is copied away and the original deleted, the whole directory can be checked at once: every file
against the size and SHA-256 recorded in ``metadata.json`` at save, and every tensor the metadata lists
read back from its shards (each piece where the metadata places it, at the size it records).
"""
from __future__ import annotations

import os

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.resharding import CheckpointReader


def verify_checkpoint(directory: str) -> str:
    """Check one ``iter_*`` directory completely; return a one-line summary, raise CheckpointError naming
    the first bad file."""
    reader = CheckpointReader(directory)
    files = reader.metadata["files"]
    storage.verify_files(directory, reader.metadata, checksum=set(files))
    for key in reader.tensors:
        reader.read(key)
    size = sum(entry["size"] for entry in files.values())
    return (f"{directory}: iteration {reader.metadata['iteration']}, {len(files)} files ({size / 2**20:.1f} MiB) "
            f"match their SHA-256, {len(reader.tensors)} tensors read back whole")


def checkpoints_to_verify(path: str, *, all_iterations: bool) -> list[str]:
    """The directories ``path`` names: an ``iter_*`` directory itself; a checkpoint root's newest (the
    tracker's), or with ``all_iterations`` every committed ``iter_*`` in it, oldest first."""
    if not all_iterations or os.path.isfile(os.path.join(path, storage.METADATA_FILE)):
        return [storage.resolve_checkpoint_dir(path)]
    names = sorted(name for name in os.listdir(path) if name.startswith("iter_") and not name.endswith(".old"))
    if not names:
        raise storage.CheckpointError(f"{path} holds no iter_* checkpoint directories.")
    return [os.path.join(path, name) for name in names]
