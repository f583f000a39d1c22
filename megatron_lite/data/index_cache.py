"""Build-once, load-everywhere cache for the numpy index arrays of GPT and blended datasets.

One rank builds the arrays and saves them under a name derived from a hash of everything
that determines them; the other ranks wait for the files and memory-map them. Each array is
written under a temporary name and renamed, and the JSON description is written last, so a
reader that sees the description sees complete arrays.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable

import numpy as np

from megatron_lite.files import atomic_write

DEFAULT_WAIT_TIMEOUT_S = 600.0
_POLL_INTERVAL_S = 0.2


def cache_prefix(cache_dir: str, kind: str, description: dict) -> str:
    """``{cache_dir}/{md5 of the description}-{kind}``: equal parameters give the same files on every rank."""
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()
    return os.path.join(cache_dir, f"{digest}-{kind}")


def _save_atomically(path: str, write: Callable) -> None:
    with atomic_write(path, "wb") as f:
        write(f)


def load_or_build(prefix: str, description: dict, names: tuple[str, ...], build: Callable[[], dict],
                  *, is_builder_rank: bool, timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> dict:
    """Returns {name: array} for ``names``, building and saving them on the builder rank if not cached."""
    marker = f"{prefix}-description.json"
    if not os.path.exists(marker):
        if is_builder_rank:
            arrays = build()
            cache_dir = os.path.dirname(prefix)
            try:
                os.makedirs(cache_dir, exist_ok=True)
                for name in names:
                    _save_atomically(f"{prefix}-{name}.npy", lambda f, name=name: np.save(f, arrays[name]))
                _save_atomically(marker, lambda f: f.write(json.dumps(description, indent=2).encode("utf-8")))
            except OSError as error:
                raise OSError(f"cannot write the dataset index cache to {cache_dir} ({error}); pass "
                              "--data-cache-path with a writable directory that every rank can read.") from error
            return arrays
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for {marker}, which the builder rank (global rank 0) writes. "
                    "Build the datasets on rank 0 first (is_builder_rank=True), and make sure the cache "
                    "directory is on a filesystem every rank sees, or set --data-cache-path to one.")
            time.sleep(_POLL_INTERVAL_S)
    return {name: np.load(f"{prefix}-{name}.npy", mmap_mode="r") for name in names}
