"""Every random-number state a rank draws from, as tensors (for safetensors) and JSON scalars.

Python's ``random``, numpy's global generator, torch's CPU and CUDA generators and
the tensor-parallel tracker's named states (dropout inside tensor-parallel regions).
Restoring them all is what makes a resumed run draw the same dropout masks as an
uninterrupted one.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from megatron_lite.tensor_parallel.random import get_rng_tracker

PREFIX = "rng."


def get_rng_state() -> tuple[dict, dict]:
    """(tensors, scalars): this process's generator states, ready for safetensors and JSON."""
    version, mt_state, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {"python": torch.tensor(mt_state, dtype=torch.int64),
               "numpy": torch.from_numpy(np_keys.astype(np.int64)),
               "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    for name, states in get_rng_tracker().get_states().items():
        for device, state in states.items():
            tensors[f"tracker.{name}.{device}"] = state
    scalars = {"python": [version, gauss_next], "numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)]}
    return {PREFIX + k: v for k, v in tensors.items()}, scalars


def set_rng_state(tensors: dict, scalars: dict) -> None:
    """Inverse of ``get_rng_state``; ``tensors`` may hold other keys too (only ``rng.*`` are read)."""
    tensors = {k.removeprefix(PREFIX): v for k, v in tensors.items() if k.startswith(PREFIX)}
    version, gauss_next = scalars["python"]
    random.setstate((version, tuple(tensors["python"].tolist()), gauss_next))
    np_kind, np_pos, np_has_gauss, np_gauss = scalars["numpy"]
    np.random.set_state((np_kind, tensors["numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    tracker: dict = {}
    for key, state in tensors.items():
        if key.startswith("tracker."):
            name, device = key.removeprefix("tracker.").rsplit(".", 1)
            tracker.setdefault(name, {})[device] = state
    get_rng_tracker().set_states(tracker)

