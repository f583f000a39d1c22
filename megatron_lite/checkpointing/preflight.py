"""Checks on --save and --load made at start-up, before any compute is spent.

Without them an unwritable --save fails at the first save, which without
--save-interval is the end of the run: the whole run is lost. A --finetune whose
--load holds nothing, or a --pretrained-checkpoint that holds nothing, would quietly
train from random weights.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

from megatron_lite.checkpointing.loading import checkpoint_to_load
from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.config import Config, ConfigError

# Adam's fp32 main weight and two moments per parameter, saved beside the weights.
OPTIMIZER_BYTES_PER_PARAMETER = 12


def check_checkpoint_paths(config: Config, num_parameters: int) -> tuple[str, int, bool] | None:
    """Raise CheckpointError naming the path and the fix; call on every rank (each writes its own file).
    Returns the checkpoint the run starts from (``checkpoint_to_load``), None for a fresh start."""
    checkpoint = config.checkpoint
    if checkpoint.save:
        bytes_per_parameter = config.params_dtype.itemsize + OPTIMIZER_BYTES_PER_PARAMETER
        check_save_dir(checkpoint.save, needed_bytes=num_parameters * bytes_per_parameter)
    return checkpoint_to_load(checkpoint)  # fine-tuning from a missing checkpoint fails here, before the model


def check_peft_has_a_base(config: Config) -> None:
    """--peft starts from a checkpoint, or says it means not to: the command line's check (the Config API
    keeps training adapters on random weights, as tests do)."""
    if config.peft.peft is None or config.peft.peft_without_base_checkpoint:
        return
    if checkpoint_to_load(config.checkpoint) is None:
        raise ConfigError(f"--peft {config.peft.peft} trains adapters on a frozen base model, but no checkpoint is "
                          f"given to be the base (--pretrained-checkpoint, or --load with a checkpoint): the base "
                          f"would be random weights. Give --pretrained-checkpoint BASE, or add "
                          f"--peft-without-base-checkpoint if that is what you mean.")


def check_save_dir(root: str, *, needed_bytes: int) -> None:
    """``root`` can be created and written, and its file system has room for one checkpoint."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--save {root} is a file, not a directory; choose a directory for the checkpoints.")
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write_test_"):
            pass
    except OSError as error:
        raise CheckpointError(f"--save {root} is not writable ({error.strerror or error}); choose a directory "
                              "this job can write, or fix its permissions.") from None
    free = shutil.disk_usage(root).free
    if needed_bytes > free:
        leftovers = sorted(glob.glob(os.path.join(glob.escape(root), ".iter_*.tmp")))
        named = (f" Unfinished saves (a killed run's) hold space there: {', '.join(leftovers)}; remove them."
                 if leftovers else "")
        raise CheckpointError(f"--save {root} has {_gib(free)} free, but one checkpoint of this model needs "
                              f"about {_gib(needed_bytes)} (weights and optimizer state); free space or "
                              f"choose another directory.{named}")


def _gib(size: int) -> str:
    """Sizes of a tiny test model read 0.0 GiB: say MiB below a GiB."""
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
