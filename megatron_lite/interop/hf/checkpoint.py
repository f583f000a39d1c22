"""Hugging Face model directories <-> megatron_lite checkpoints: import, export, and the files of each.

A Hugging Face model directory is ``config.json`` plus safetensors weights
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``).
Both are read as data, never unpickled, and transformers itself is not needed. How each family's
names and fields map to ours: ``interop.hf.weights`` and ``interop.hf.families``.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os

import safetensors
import safetensors.torch

from megatron_lite.checkpointing.offline import write_checkpoint
from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.checkpointing.contents import OPTIMIZER_PREFIX
from megatron_lite.checkpointing.storage import check_is_directory, resolve_checkpoint_dir
from megatron_lite.config import Config, ConfigError, ParallelConfig
from megatron_lite.interop.hf.families import FAMILIES, config_json
from megatron_lite.interop.hf.multi_token_prediction import without_absent_mtp_layers
from megatron_lite.interop.hf.pad_token import note_trained_pad_token
from megatron_lite.interop.hf.tokenizer import export_tokenizer, import_tokenizer, write_json
from megatron_lite.interop.hf.weights import hf_family, model_config_from_hf, weights_from_hf, weights_to_hf
from megatron_lite.tokenizer import build_tokenizer, checkpoint_tokenizer_flags

HF_SOURCE_FILE = "hf_source.json"  # beside an imported checkpoint's tracker: the directory it came from


# ---------------------------------------------------------------------------------------------
# Directories


def read_hf_directory(directory: str) -> tuple[dict, dict]:
    """(config.json as a dict, every weight by name) from a local Hugging Face model directory."""
    check_is_directory(directory, "Hugging Face model directory")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{directory} has no config.json: pass a Hugging Face model directory to --load-dir.")
    with open(config_path) as f:
        hf_config = json.load(f)
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{directory} has no model.safetensors (or model.safetensors.index.json). megatron_lite reads only "
            f"safetensors, never pickles (pytorch_model.bin can run code when loaded); {_safetensors_hint()}")
    tensors = {}
    for name in files:
        with safetensors.safe_open(os.path.join(directory, name), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return hf_config, tensors


def _safetensors_hint() -> str:
    """How to rewrite a pickled model as safetensors with the transformers installed here: save_pretrained
    writes safetensors by default from 4.35 and only safetensors from 5, which dropped ``safe_serialization``."""
    load = "load it with transformers' AutoModelForCausalLM.from_pretrained(DIR)"
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return f"pip install transformers, then {load} and call save_pretrained(NEW_DIR)."
    major, minor = (int(part) if part.isdigit() else 0 for part in (version.split(".") + ["0"])[:2])
    if (major, minor) < (4, 35):
        return (f"{load} and call save_pretrained(NEW_DIR, safe_serialization=True) (transformers {version} writes "
                f"pickles by default).")
    return f"{load} and call save_pretrained(NEW_DIR) (transformers {version} writes safetensors)."


def write_hf_directory(directory: str, hf_config: dict, tensors: dict, *, tokenizer_flags: dict | None = None,
                       prompt_format: str | None = None) -> None:
    """config.json, model.safetensors and, when there is a tokenizer, its files and generation_config.json
    (with the chat template of ``prompt_format``, a chat fine-tune's ``--sft-tokenizer-prompt-format``).

    Every file is made readable by all (0644): an export is meant to be shared, and a umask
    of 077, common on clusters, would leave it readable by its writer alone.
    """
    os.makedirs(directory, exist_ok=True)
    special_ids = export_tokenizer(tokenizer_flags or {}, directory,
                                   model_max_length=hf_config.get("n_positions", hf_config.get(
                                       "max_position_embeddings")), prompt_format=prompt_format)
    write_json(os.path.join(directory, "config.json"), {**hf_config, **special_ids["config.json"]})
    if special_ids["generation_config.json"]["eos_token_id"] is not None:
        write_json(os.path.join(directory, "generation_config.json"),
                   {**special_ids["generation_config.json"], "do_sample": False})
    safetensors.torch.save_file({k: v.float().contiguous() for k, v in tensors.items()},
                                os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o644)


# ---------------------------------------------------------------------------------------------
# Whole checkpoints


def import_hf_checkpoint(load_dir: str, save_dir: str, *, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1) -> str:
    """A Hugging Face directory (a family of ``families``) -> a weights-only megatron_lite checkpoint
    (iteration 0) that records the directory's tokenizer files, if any, and the directory itself
    (``HF_SOURCE_FILE``: the base that a PEFT export of adapters trained on this checkpoint names)."""
    hf_config, tensors = read_hf_directory(load_dir)
    model_config = dataclasses.replace(model_config_from_hf(hf_config), hf_model_type=hf_config["model_type"])
    model_config = without_absent_mtp_layers(model_config, tensors)
    weights = weights_from_hf(tensors, model_config, FAMILIES[hf_config["model_type"]].naming,
                              interleaved_rope=hf_config.get("rope_interleave", True))
    config = Config(model=model_config, parallel=ParallelConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size))
    tokenizer_flags = import_tokenizer(load_dir)
    _check_vocabulary_holds_tokenizer(load_dir, model_config.vocab_size, tokenizer_flags)
    note_trained_pad_token(hf_config, tokenizer_flags, has_padding_idx=FAMILIES[hf_config["model_type"]].padding_idx)
    config.data = dataclasses.replace(config.data, **tokenizer_flags)
    written = write_checkpoint(save_dir, config, weights.__getitem__, iteration=0)
    with open(os.path.join(save_dir, HF_SOURCE_FILE), "w") as f:
        json.dump({"directory": os.path.abspath(load_dir)}, f)
    return written


def _check_vocabulary_holds_tokenizer(load_dir: str, vocab_size: int, tokenizer_flags: dict) -> None:
    """The tokenizer beside config.json makes no id past its vocab_size: such an id has no embedding row, and
    fine-tuning would find out only once the data is tokenized (a smaller tokenizer is common: rows padded)."""
    if not tokenizer_flags:
        return
    tokens = build_tokenizer(**tokenizer_flags).vocab_size
    if tokens > vocab_size:
        files = ", ".join(os.path.basename(v) for k, v in tokenizer_flags.items() if k != "tokenizer_type")
        raise ConfigError(f"{load_dir}: config.json's vocab_size ({vocab_size}) is smaller than the tokenizer beside "
                          f"it ({files}: {tokens} tokens), so ids {vocab_size}-{tokens - 1} would have no embedding "
                          f"row. The config.json or the tokenizer files belong to another model: put the model's own "
                          f"tokenizer beside it (or fix vocab_size to the embedding's rows).")


def imported_from(checkpoint_root: str) -> str | None:
    """The Hugging Face directory a checkpoint root was imported from, or None (trained here, or older)."""
    try:
        with open(os.path.join(checkpoint_root, HF_SOURCE_FILE)) as f:
            return json.load(f)["directory"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_hf_checkpoint(load_dir: str, save_dir: str, *, tokenizer_flags: dict | None = None,
                         hf_model_type: str | None = None) -> None:
    """A megatron_lite checkpoint (root or iter_* directory, any layout) -> a Hugging Face directory.

    The tokenizer is ``tokenizer_flags`` ({tokenizer_type, vocab_file, ...}) when given, else the
    one the checkpoint was trained with. ``hf_model_type``: the family to write (``hf_family``)."""
    reader = CheckpointReader(resolve_checkpoint_dir(load_dir))
    config = Config.from_dict(reader.metadata["config"])
    if config.peft.peft == "lora":
        raise ConfigError(f"{load_dir} is an adapter checkpoint (--peft lora), which holds no base "
                          f"weights: add --merge-lora to export the base with the LoRA update merged in, or use "
                          f"--target-format peft to export the adapters alone.")
    if config.peft.peft is not None:  # neither merges into the weights, and Hugging Face PEFT gets LoRA only
        folding = (" (--fold-prefix-projection rewrites it without its reparametrising MLP)"
                   if config.peft.peft == "prefix" else "")
        raise ConfigError(f"{load_dir} is a --peft {config.peft.peft} checkpoint, which has no Hugging Face form: "
                          f"its weights do not merge into the base (that is LoRA's --merge-lora) and the PEFT "
                          f"export takes LoRA only. It stays a megatron_lite checkpoint{folding}: generate, evaluate "
                          f"or fine-tune on with it as --load (its base loads with it); export its base on its own.")
    reader.verify([k for k in reader.tensors if not k.startswith(OPTIMIZER_PREFIX)])
    export_hf_weights(config, reader.read, save_dir, tokenizer_flags=tokenizer_flags, hf_model_type=hf_model_type)


def export_hf_weights(config: Config, read, save_dir: str, *, tokenizer_flags: dict | None = None,
                      hf_model_type: str | None = None) -> None:
    """A Hugging Face directory of the model ``config`` describes, from its global tensors ``read(name)``."""
    family = hf_family(config.model, hf_model_type)
    tokenizer = checkpoint_tokenizer_flags(dataclasses.asdict(config.data), tokenizer_flags or {})
    write_hf_directory(save_dir, config_json(family, config.model), weights_to_hf(read, config.model, family.naming),
                       tokenizer_flags=tokenizer,
                       prompt_format=config.data.sft_tokenizer_prompt_format if config.data.sft else None)
