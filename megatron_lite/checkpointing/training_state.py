"""What the training loop carries between iterations; checkpoints save and restore it.

It lives here, below the loop, because checkpointing restores it and the loop imports checkpointing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainingState:
    """Progress of a run, independent of the parallel layout."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    losses: list = field(default_factory=list)  # lm loss per iteration, on the last pipeline stage
    peft_base: Optional[dict] = None  # with --peft: the base model the adapters train on (checkpointing/peft_base)
