"""What every mixture-of-experts layer is told about how its experts are split, as one object.

The model builder makes one from the run's ``ParallelState`` and hands it down with the
``TensorParallelConfig``, as Megatron-Core's ``ModelParallelConfig`` carries both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExpertParallelConfig:
    """``ep_group``: the ranks the experts are divided over (None: one rank holds them all).
    ``etp_group``: the ranks each expert's weights are split over (None: whole on every rank)."""

    ep_group: Any = None
    etp_group: Any = None
