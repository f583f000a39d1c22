"""Flags taken from a checkpoint: ``--use-checkpoint-args``, and the tokenizer of a resumed run.

Both run while the command line is parsed, before any process group exists: every rank reads the
same metadata.json itself, so all ranks build the same model and a bad checkpoint fails before any
compute. They work on the parsed flags by field name (``arguments.build_parser``'s namespace).
"""
from __future__ import annotations

from megatron_lite.checkpointing.architecture import model_args_from_checkpoint, worth_showing
from megatron_lite.interop.megatron.importer import as_megatron_lite_checkpoint
from megatron_lite.checkpointing.peft_base import peft_fields_from_checkpoint
from megatron_lite.checkpointing.loading import checkpoint_to_load, read_config
from megatron_lite.checkpointing.storage import CheckpointError, read_latest_iteration
from megatron_lite.config import (CheckpointConfig, ConfigError, DataConfig, as_flags, missing_model_flags,
                                  section_values)
from megatron_lite.process_groups.initialize import resolve_launch_env
from megatron_lite.tokenizer import TOKENIZER_FIELDS


def megatron_checkpoints_imported(values: dict) -> dict:
    """--load / --pretrained-checkpoint naming a Megatron-LM checkpoint: the same flags naming its import."""
    return {flag: as_megatron_lite_checkpoint(values[flag]) for flag in ("load", "pretrained_checkpoint")
            if values.get(flag)}


def checkpoint_model_args(values: dict) -> dict:
    """--use-checkpoint-args: the model flags the command line leaves out, from the checkpoint the run loads."""
    source = checkpoint_to_load(CheckpointConfig(**section_values(values, CheckpointConfig)))
    if source is None:  # a first launch whose --load is still empty: the command line must give the model
        missing = missing_model_flags(values)
        if missing:
            raise ConfigError(f"--use-checkpoint-args found no checkpoint in --load {values['load']} to take the "
                              f"model from, and {' '.join(missing)} are not given: add --pretrained-checkpoint DIR "
                              f"(the checkpoint to start from), or give the model flags.")
        return {}
    root = source[0]
    saved = read_config(root)
    # The vocabulary size is the checkpoint's too (the tokenizer's is not consulted): it is the embedding's.
    taken = model_args_from_checkpoint(values, saved.model, root)
    taken.update(peft_fields_from_checkpoint(values, saved.peft))  # an adapter checkpoint's LoRA rank and so on
    taken.update(_tokenizer_args_from_checkpoint(values, saved.data))
    if resolve_launch_env().rank == 0:
        # All of them are taken, but only those that mean something for this model are worth reading.
        shown = {name: value for name, value in taken.items() if worth_showing(name, saved.model)}
        print(f" --use-checkpoint-args: the model of {root}: {as_flags(shown)}", flush=True)
    return taken


def resumed_run_tokenizer_args(values: dict) -> dict:
    """A run resumed from its own --load with no tokenizer flags keeps the checkpoint's tokenizer.

    A resume continues the same run on the same data, so the tokenizer cannot have changed. A fine-tune
    (--finetune, or --pretrained-checkpoint while --load is still empty) starts a new run whose data may
    come from another tokenizer: it keeps what its command line says, and --use-checkpoint-args opts in.
    """
    if values.get("tokenizer_type") is not None or not values.get("load") or values.get("finetune"):
        return {}
    if read_latest_iteration(values["load"]) is None:  # a first launch, or --pretrained-checkpoint's turn
        return {}
    try:
        saved = read_config(values["load"])
    except CheckpointError:  # an unfinished or foreign checkpoint: the load itself reports it, with its fix
        return {}
    taken = _tokenizer_args_from_checkpoint(values, saved.data)
    if taken and resolve_launch_env().rank == 0:
        print(f"note: resuming from --load {values['load']} with its tokenizer: "
              f"{as_flags({name: taken[name] for name in TOKENIZER_FIELDS})}", flush=True)
    return taken


def _tokenizer_args_from_checkpoint(values: dict, saved: DataConfig) -> dict:
    """The checkpoint's tokenizer and its files when the command line names none (Megatron-LM takes
    --tokenizer-type), so the checkpoints this run saves still record the tokenizer that generation and
    the Hugging Face export read."""
    if values.get("tokenizer_type") is not None or saved.tokenizer_type is None:
        return {}
    return {name: getattr(saved, name) for name in (*TOKENIZER_FIELDS, "tiktoken_pattern",
                                                    "tiktoken_num_special_tokens")}
