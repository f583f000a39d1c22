"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoints: one pickle per model-parallel rank.

    ROOT/latest_checkpointed_iteration.txt          "1000" (or "release")
    ROOT/iter_0001000/mp_rank_00/model_optim_rng.pt           pipeline size 1: mp_rank_{tp:02d}
    ROOT/iter_0001000/mp_rank_01_002/model_optim_rng.pt       else mp_rank_{tp:02d}_{pp:03d}
    ROOT/iter_0001000/mp_rank_01_002_001/model_optim_rng.pt   expert parallelism adds _{ep:03d}

With expert parallelism each expert-parallel rank's file holds the dense weights again (the same on every
one) and its own experts, numbered from 0 (``local_experts.0``). A name with one suffix (``mp_rank_00_001``)
is a pipeline rank or an expert rank: the saved args' pipeline size tells which.

Each file holds ``model`` (that rank's shards), ``args``, ``iteration``,
``checkpoint_version``, optionally ``optimizer``, ``opt_param_scheduler`` and
``rng_state``. Only ``model``, ``args`` and ``iteration`` are read: the optimizer state
of a legacy file is the flattened state of Megatron's optimizer wrappers, which does
not map exactly onto ours, so an import starts it fresh. An export writes the same
files with ``model``, ``args``, ``iteration`` and ``checkpoint_version`` 3.0 (no optimizer,
scheduler or RNG state: Megatron-LM then starts them fresh, as with ``--finetune``).
"""
from __future__ import annotations

import os
import re

import torch

from megatron_lite.interop.megatron.safe_unpickle import load_torch_file
from megatron_lite.checkpointing.storage import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
# Version 3.0: the fused QKV grouped per query group, the layout Megatron-Core writes.
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})((?:_\d{3}){0,2})$")


def iteration_dir(path: str) -> str:
    """The ``iter_*`` (or ``release``) directory of a checkpoint root, or ``path`` if it is one."""
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return path
    with open(tracker) as f:
        marker = f.read().strip()
    return os.path.join(path, "release" if marker == "release" else f"iter_{int(marker):07d}")


def _named_files(directory: str) -> dict:
    """{(tensor rank, (the name's other numbers)): file} of a legacy iteration directory."""
    files = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        match = _RANK_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, MODEL_FILE)):
            suffix = tuple(int(number) for number in match.group(2).split("_")[1:])
            files[int(match.group(1)), suffix] = os.path.join(directory, name, MODEL_FILE)
    return files


def has_rank_files(directory: str) -> bool:
    return bool(_named_files(directory))


def rank_files(directory: str) -> dict:
    """{(tensor rank, pipeline rank, expert rank): file} of a legacy iteration directory."""
    named = _named_files(directory)
    pipelined = False
    if any(len(suffix) == 1 for _, suffix in named):  # mp_rank_TT_NNN: a pipeline rank, or an expert rank
        pipelined = getattr(read_rank_file(next(iter(named.values())))["args"], "pipeline_model_parallel_size", 1) > 1
    ranks = {0: lambda s: (0, 0), 2: lambda s: s, 1: lambda s: (s[0], 0) if pipelined else (0, s[0])}
    return {(tensor, *ranks[len(suffix)](suffix)): path for (tensor, suffix), path in named.items()}


def read_rank_file(path: str) -> dict:
    """One rank's file, read with the restricted unpickler; refuses what we cannot interpret."""
    state = load_torch_file(path)
    if "model" not in state:
        names = sorted(k for k in state if k.startswith("model"))
        what = f"virtual-pipeline chunks {names}" if names else f"no 'model' entry (keys: {sorted(state)[:8]})"
        raise CheckpointError(f"{path} holds {what}: megatron_lite imports checkpoints saved without "
                              f"--num-layers-per-virtual-pipeline-stage.")
    version = state.get("checkpoint_version", 0)
    if version < 2.0:
        raise CheckpointError(f"{path} has checkpoint_version {version}: its fused QKV is ordered as before "
                              f"Megatron-LM's version 2.0; load and re-save it with Megatron-LM first.")
    return state


def iteration_path(root: str, iteration: int) -> str:
    """``root/iter_{iteration:07d}``: where Megatron-LM writes an iteration, in either format."""
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir_name(tensor_rank: int, pipeline_rank: int, pipeline_size: int, expert_rank: int | None = None) -> str:
    """``mp_rank_TT`` (pipeline size 1) or ``mp_rank_TT_PPP``, then ``_EEE`` under expert parallelism
    (``expert_rank`` given), as Megatron-LM names a rank's directory."""
    name = f"mp_rank_{tensor_rank:02d}" if pipeline_size == 1 else f"mp_rank_{tensor_rank:02d}_{pipeline_rank:03d}"
    return name if expert_rank is None else f"{name}_{expert_rank:03d}"


def write_rank_file(root: str, iteration: int, tensor_rank: int, pipeline_rank: int, pipeline_size: int, *,
                    model: dict, args, expert_rank: int | None = None) -> str:
    """One rank's ``model_optim_rng.pt`` under ``root/iter_{iteration:07d}``."""
    directory = os.path.join(iteration_path(root, iteration),
                             rank_dir_name(tensor_rank, pipeline_rank, pipeline_size, expert_rank))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MODEL_FILE)
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "model": model,
                "num_floating_point_operations_so_far": 0}, path)
    return path


def write_tracker(root: str, iteration: int) -> None:
    """``latest_checkpointed_iteration.txt``, written last: Megatron-LM reads a checkpoint only once it names it."""
    with open(os.path.join(root, TRACKER_FILE), "w") as f:
        f.write(str(iteration))
