"""What every tensor-parallel layer is told about the layout, as one object.

Megatron-Core hands each layer a ``ModelParallelConfig``; this is its tensor-parallel part.
The model builder makes one from the run's ``ParallelState`` and flags, and the model hands
it down to every layer unchanged, so a new layer takes one argument, not three.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tp_group``: the tensor-parallel group (None for one rank). ``sequence_parallel``: activations
    between the tensor-parallel regions are split along the sequence ([s/tp, b, h]). ``params_dtype``:
    the dtype parameters are allocated in."""

    tp_group: Any = None
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32

