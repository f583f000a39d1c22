"""Adapter checkpoints: only the PEFT weights, and which base model they were trained on.

A PEFT run trains a few weights on top of a frozen base. Its checkpoints store the
trainable tensors only (with their optimizer state, as any checkpoint), plus a
pointer to the base in ``training_state.peft_base``:

    {"directory": "/abs/base/iter_0000100", "iteration": 100, "metadata_sha256": "..."}
        the base checkpoint; the SHA-256 of its metadata.json, which itself records the
        SHA-256 of every tensor file, pins the exact weights
    {"init_seed": 1234, "init_method_std": 0.02}
        no base checkpoint: the base is the layout-independent random initialisation

Loading an adapter checkpoint loads the base from the pointer first (checking the
checksum), then the adapters; loading a full checkpoint into a PEFT run makes it
the base (weights only) and the pointer of every later save. ``merged_lora`` folds a
LoRA checkpoint into its base, for the converter to write in any format, and
``folded_prefix`` replaces prefix tuning's reparametrising MLP by the prefixes it computes.
"""
from __future__ import annotations

import dataclasses
import os

from typing import Callable

import torch

from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.checkpointing.storage import METADATA_FILE, CheckpointError, sha256_file
from megatron_lite.config import Config, ConfigError, PeftConfig, flag_name
from megatron_lite.peft.lora import factor_names, merged_weight
from megatron_lite.peft.prefix_tuning import fold_projection

# PEFT settings that change what the adapted model computes (dropout only changes training).
_FUNCTION_FIELDS = {"lora": ("lora_rank", "lora_alpha", "lora_target_modules"),
                    "adapter": ("adapter_dim",),
                    "prefix": ("prefix_length", "prefix_projection_hidden_size")}


def saved_peft(metadata: dict) -> PeftConfig:
    """The PEFT settings a checkpoint was saved with (none for checkpoints older than PEFT)."""
    return PeftConfig(**metadata["config"].get("peft", {}))


def pointer_to(directory: str, metadata: dict) -> dict:
    """The pointer to a full checkpoint directory, for the adapter checkpoints trained on it."""
    return {"directory": os.path.abspath(directory), "iteration": metadata["iteration"],
            "metadata_sha256": sha256_file(os.path.join(directory, METADATA_FILE))}


def pointer_to_initialisation(config: Config) -> dict:
    return {"init_seed": config.training.seed, "init_method_std": config.model.init_method_std}


def weight_sources(config: Config, reader: CheckpointReader) -> tuple:
    """(reader for the frozen weights, reader for the trainable ones, base pointer) when loading ``reader``.

    A reader of None means the weights keep their initial values: a full checkpoint loaded
    into a PEFT run provides the base only, and a base that is the random initialisation
    has no checkpoint. Without --peft everything trains and comes from ``reader``.
    """
    saved, peft = saved_peft(reader.metadata), config.peft
    if peft.peft is None:
        if saved.peft is not None:
            raise ConfigError(
                f"{reader.directory} is an adapter checkpoint (--peft {saved.peft}): it holds only the "
                f"{saved.peft} weights. Add --peft {saved.peft} (and --use-checkpoint-args for its settings) to "
                f"load it onto its base, or merge it into the base with tools/checkpoint_convert.py --merge-lora.")
        return None, reader, None
    if saved.peft is None:
        return reader, None, pointer_to(reader.directory, reader.metadata)
    _check_same_peft(saved, peft, reader.directory)
    pointer = reader.metadata["training_state"].get("peft_base")
    if pointer is None:
        raise CheckpointError(f"adapter checkpoint {reader.directory} does not say which base it was trained on "
                              f"(training_state.peft_base is missing); it is incomplete.")
    return open_base(pointer, config, reader.directory), reader, pointer


def open_base(pointer: dict, config: Config, adapter_directory: str) -> CheckpointReader | None:
    """The base checkpoint a pointer names, after checking it is the one the adapters were trained on."""
    if "init_seed" in pointer:
        run = pointer_to_initialisation(config)
        if run != pointer:
            raise ConfigError(
                f"the adapters in {adapter_directory} were trained on a randomly initialised base (--seed "
                f"{pointer['init_seed']}, --init-method-std {pointer['init_method_std']}), this run would "
                f"initialise it with --seed {run['init_seed']}, --init-method-std {run['init_method_std']}: "
                f"pass the checkpoint's values.")
        return None
    directory = pointer["directory"]
    metadata_path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(metadata_path):
        raise CheckpointError(f"the adapters in {adapter_directory} were trained on the base checkpoint {directory}, "
                              f"which is gone ({METADATA_FILE} missing). Restore it there: the adapters are "
                              f"meaningless without their base.")
    if sha256_file(metadata_path) != pointer["metadata_sha256"]:
        raise CheckpointError(f"the base checkpoint {directory} is not the one the adapters in {adapter_directory} "
                              f"were trained on: its {METADATA_FILE} has another SHA-256 (it was overwritten or "
                              f"re-saved). Restore the original base checkpoint.")
    return CheckpointReader(directory)


def _check_same_peft(saved: PeftConfig, peft: PeftConfig, directory: str) -> None:
    if saved.peft != peft.peft:
        raise ConfigError(f"{directory} holds --peft {saved.peft} weights, this run uses --peft {peft.peft}.")
    differences = [f"  {flag_name(name)}: checkpoint {getattr(saved, name)}, this run {getattr(peft, name)}"
                   for name in _FUNCTION_FIELDS[peft.peft] if getattr(saved, name) != getattr(peft, name)]
    if differences:
        raise ConfigError(f"this run's --peft {peft.peft} settings differ from the adapter checkpoint's "
                          f"({directory}):\n" + "\n".join(differences) +
                          "\nSet them to the checkpoint's values, or add --use-checkpoint-args.")


def peft_fields_from_checkpoint(given: dict, saved: PeftConfig) -> dict:
    """--use-checkpoint-args: the PEFT settings of an adapter checkpoint that the command line leaves out.

    As for the model's flags, a given setting that changes what the adapters compute must agree (one error
    lists those that do not); the advice of the later check, "add --use-checkpoint-args", would not help."""
    if saved.peft is None:
        return {}
    conflicts = [f"  {flag_name(name)}: checkpoint {getattr(saved, name)}, this run {given[name]}"
                 for name in _FUNCTION_FIELDS[saved.peft] if name in given and given[name] != getattr(saved, name)]
    if conflicts:
        raise ConfigError("--use-checkpoint-args takes the --peft settings from the adapter checkpoint, but these "
                          "flags contradict it:\n" + "\n".join(conflicts) + "\nDrop them: the checkpoint's values "
                          "apply.")
    return {f.name: getattr(saved, f.name) for f in dataclasses.fields(PeftConfig) if f.name not in given}


def adapter_reader(directory: str, method: str) -> tuple[CheckpointReader, Config]:
    """The checkpoint in ``directory`` (verified) and its config, which must be a --peft ``method`` one."""
    reader = CheckpointReader(directory)
    config = Config.from_dict(reader.metadata["config"])
    if config.peft.peft != method:
        what = "a full checkpoint" if config.peft.peft is None else f"a --peft {config.peft.peft} checkpoint"
        raise ConfigError(f"{directory} is {what}, not a LoRA adapter checkpoint: only LoRA's low-rank updates "
                          f"can be merged into the base weights or exported to Hugging Face PEFT.")
    reader.verify([k for k in reader.tensors if not k.startswith("optimizer.")])
    return reader, config


def merged_lora(directory: str) -> tuple[Config, Callable[[str], torch.Tensor]]:
    """(the base model's config, ``read(name)``: its global tensors with W + (alpha / r) B A merged in)."""
    reader, config = adapter_reader(directory, "lora")
    pointer = reader.metadata["training_state"].get("peft_base") or {}
    if "directory" not in pointer:
        raise ConfigError(f"the adapters in {directory} were trained on a randomly initialised base, which no "
                          f"checkpoint holds: there are no base weights to merge them into.")
    base = open_base(pointer, config, directory)
    base.verify([k for k in base.tensors if not k.startswith("optimizer.")])
    scaling = config.peft.lora_alpha / config.peft.lora_rank

    def read(name: str) -> torch.Tensor:
        lora_a, lora_b = factor_names(name.removesuffix(".weight"))
        if lora_a not in reader.tensors:
            return base.read(name)
        return merged_weight(base.read(name), reader.read(lora_a), reader.read(lora_b), scaling)

    return dataclasses.replace(config, peft=PeftConfig()), read


def folded_prefix(directory: str) -> tuple[Config, Callable[[str], torch.Tensor], dict]:
    """(config without the prefix MLP, ``read(name)`` of the plain prefixes, training state with the base
    pointer) of a --peft prefix checkpoint trained with --prefix-projection-hidden-size."""
    reader, config = adapter_reader(directory, "prefix")
    if config.peft.prefix_projection_hidden_size is None:
        raise ConfigError(f"{directory} learned its prefixes directly (no --prefix-projection-hidden-size): "
                          f"there is no projection to fold.")

    def read(name: str) -> torch.Tensor:
        prefix = name.removesuffix("key_value")
        return fold_projection(reader.read(prefix + "embedding"),
                               *[(reader.read(f"{prefix}{linear}.weight"), reader.read(f"{prefix}{linear}.bias"))
                                 for linear in ("linear_in", "linear_out")])

    folded = dataclasses.replace(config, peft=dataclasses.replace(config.peft, prefix_projection_hidden_size=None))
    return folded, read, {"iteration": 0, "peft_base": reader.metadata["training_state"].get("peft_base")}
