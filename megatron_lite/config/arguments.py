"""Command line -> Config, with Megatron-LM's flag names.

Flags are generated from the config dataclasses' fields (``micro_batch_size`` ->
``--micro-batch-size``), so every option is reachable and named as in Megatron-LM.
Booleans that default to True are switched off with Megatron's negative spelling
(``--disable-bias-linear``, ``--no-fused-kernels``). ``--use-checkpoint-args`` fills the
model flags from the checkpoint to be loaded; a run resumed from --load keeps its checkpoint's
tokenizer when the command line names none. Megatron-LM flags with no setting here are
accepted as no-ops or refused by name (``megatron_compat``); any other unknown flag is an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing

from megatron_lite.checkpointing.architecture import model_args_from_checkpoint
from megatron_lite.checkpointing.megatron.importer import as_megatron_lite_checkpoint
from megatron_lite.checkpointing.peft_base import peft_fields_from_checkpoint
from megatron_lite.checkpointing.save_load import checkpoint_to_load, read_config
from megatron_lite.checkpointing.sft_prompt_format import prompt_format_from_checkpoint
from megatron_lite.checkpointing.storage import CheckpointError, read_latest_iteration
from megatron_lite.config import (SECTIONS, CheckpointConfig, Config, ConfigError, DataConfig, ModelConfig,
                                  as_flags, deepspeed_config, flag_name, megatron_compat)
from megatron_lite.data.vocab_check import check_tokenizer_fits_model
from megatron_lite.process_groups.initialize import resolve_launch_env
from megatron_lite.config.help_text import CHOICES, HELP
from megatron_lite.tokenizer import TOKENIZER_FIELDS

# Megatron-LM spells these two with an underscore inside; both spellings are accepted.
MEGATRON_SPELLINGS = {"override_opt_param_scheduler": "--override-opt_param-scheduler",
                      "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler"}


def _scalar_type(hint):
    """int for Optional[int], list[int] for Optional[list[int]], and so on."""
    if typing.get_origin(hint) is not typing.Union:
        return hint
    return next(a for a in typing.get_args(hint) if a is not type(None))


def _list_element_type(hint):
    """str for ``list``, int for ``list[int]``; None when ``hint`` is not a list."""
    if hint is list:
        return str
    if typing.get_origin(hint) is list:
        return (typing.get_args(hint) or (str,))[0]
    return None


def _help(f: dataclasses.Field) -> str:
    """The flag's line for --help, with its default where there is a plain one."""
    text = HELP[f.name]
    if f.default is dataclasses.MISSING or f.default is None or isinstance(f.default, bool):
        return text
    return f"{text} (default: {f.default})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing the usage block and exiting.

    Under torchrun every rank parses the flags; the usage block from each of them would
    bury the one line that says what is wrong. An unknown flag names its nearest known one.
    """

    def error(self, message: str):
        raise ConfigError(f"{message}; see --help.")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        try:
            parsed, unknown = self.parse_known_args(args, namespace)
        except ConfigError:
            # A mistyped required flag reads as a missing one: name the typo, which is what to fix.
            self.refuse_unknown(self._unknown_flags(args))
            raise
        self.refuse_unknown(unknown)
        return parsed

    def _unknown_flags(self, args: list[str]) -> list[str]:
        """The --flags in ``args`` this parser does not know, up to a "--" (after it, another command's flags)."""
        own = args[:args.index("--")] if "--" in args else args
        return [arg for arg in own if arg.startswith("--") and arg.split("=", 1)[0] not in self._option_string_actions]

    def refuse_unknown(self, unknown: list[str]) -> None:
        if unknown:
            raise ConfigError("; ".join(self._unknown_flag_message(flag) for flag in unknown
                                        if flag.startswith("-")) or f"unexpected arguments: {' '.join(unknown)}")

    def _unknown_flag_message(self, flag: str) -> str:
        name = flag.split("=", 1)[0]
        nearest = difflib.get_close_matches(name, list(self._option_string_actions), n=1, cutoff=0.75)
        hint = f" (did you mean {nearest[0]}?)" if nearest else "; see --help for the flags megatron_lite knows"
        return f"unrecognized argument {name}{hint}"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m megatron_lite.pretrain_gpt", allow_abbrev=False,
                            description="Pretrain a GPT model with tensor, pipeline and data parallelism.")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _scalar_type(hints[f.name])
            common = dict(dest=f.name, default=argparse.SUPPRESS, help=_help(f))
            element = _list_element_type(kind)
            if element is not None:
                group.add_argument(flag_name(f.name), nargs=f.metadata.get("nargs", "+"), type=element,
                                   choices=CHOICES.get(f.name), metavar=f.metadata.get("metavar"), **common)
            elif kind is bool and f.default is True:
                group.add_argument(flag_name(f.name), action="store_false", **common)
            elif kind is bool:
                spellings = [MEGATRON_SPELLINGS[f.name]] if f.name in MEGATRON_SPELLINGS else []
                group.add_argument(*spellings, flag_name(f.name), action="store_true", **common)
            else:
                group.add_argument(flag_name(f.name), type=kind, choices=CHOICES.get(f.name), **common)
            if f.name == "num_query_groups":
                group.add_argument("--group-query-attention", action="store_true",
                                   help="use --num-query-groups key/value heads (grouped-query attention)")
    megatron_compat.add_megatron_only_flags(parser)
    deepspeed_config.add_deepspeed_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse Megatron-style flags; raises ConfigError (naming the flag) on bad values."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    # Refusals first: they say why a flag cannot work, which "unrecognized" does not.
    megatron_compat.check_unknown_flags(unknown)
    namespace = vars(namespace)
    notices = megatron_compat.check_megatron_only_flags(namespace)
    parser.refuse_unknown(unknown)
    namespace, deepspeed_notices = deepspeed_config.translate_deepspeed_flags(namespace,
                                                                              resolve_launch_env().world_size)
    notices += deepspeed_notices
    if resolve_launch_env().rank == 0:  # once per job under torchrun, not once per rank
        for notice in notices:
            print(f"note: {notice}", flush=True)
    return config_from_namespace(namespace)


def config_from_namespace(namespace: dict) -> Config:
    """Parsed flags (by field name, as ``build_parser`` leaves them) -> Config, with
    --group-query-attention checked, --use-checkpoint-args applied, a resumed run's tokenizer kept and a
    fine-tuned checkpoint's chat template kept (``sft_prompt_format``)."""
    if "num_query_groups" in namespace and not namespace.pop("group_query_attention"):
        raise ConfigError("--num-query-groups needs --group-query-attention (as in Megatron-LM); add the flag.")
    namespace.pop("group_query_attention", None)
    namespace.update(_megatron_checkpoints_imported(namespace))
    if namespace.get("use_checkpoint_args"):
        namespace.update(_model_args_from_checkpoint(namespace))
    else:
        namespace.update(_tokenizer_args_of_resumed_run(namespace))
    taken = prompt_format_from_checkpoint(namespace)
    if taken and resolve_launch_env().rank == 0:
        print(f"note: fine-tuning on with the checkpoint's chat template: {as_flags(taken)}", flush=True)
    namespace.update(taken)
    return config_from_dict(namespace)


def _megatron_checkpoints_imported(values: dict) -> dict:
    """--load / --pretrained-checkpoint naming a Megatron-LM checkpoint: the same flags naming its import."""
    return {flag: as_megatron_lite_checkpoint(values[flag]) for flag in ("load", "pretrained_checkpoint")
            if values.get(flag)}


def _model_args_from_checkpoint(values: dict) -> dict:
    """--use-checkpoint-args: the model flags the command line leaves out, from the checkpoint the run loads.

    Every rank reads the same metadata.json itself, before any process group exists, so
    all ranks build the same model and a bad checkpoint fails before any compute.
    """
    source = checkpoint_to_load(CheckpointConfig(**_section(values, CheckpointConfig)))
    if source is None:  # a first launch whose --load is still empty: the command line must give the model
        missing = _missing_model_flags(values)
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
        print(f" --use-checkpoint-args: the model of {root}: {as_flags(taken)}", flush=True)
    return taken


def _tokenizer_args_of_resumed_run(values: dict) -> dict:
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


def _section(values: dict, cls) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def config_from_dict(values: dict) -> Config:
    """Distribute flat field values into the config sections and validate them."""
    sections = {section: _section(values, cls) for section, cls in SECTIONS.items()}
    if "vocab_size" in sections["model"] and values.get("tokenizer_type") in FIXED_VOCABULARY_TOKENIZERS:
        _check_tokenizer_vocab_size(values, sections["model"]["vocab_size"])
    if "vocab_size" not in sections["model"] and values.get("tokenizer_type"):
        sections["model"]["vocab_size"] = _tokenizer_vocab_size(values)
    if "vocab_size" not in sections["model"]:
        raise ConfigError("no vocabulary: give --tokenizer-type and its files (e.g. --tokenizer-type GPT2BPETokenizer "
                          "--vocab-file vocab.json --merge-file merges.txt, or SentencePieceTokenizer / "
                          "HuggingFaceTokenizer with --tokenizer-model), or --vocab-size N for --mock-data.")
    missing = _missing_model_flags(sections["model"])
    if missing:
        raise ConfigError(f"missing required model flags: {' '.join(missing)}.")
    try:
        built = {section: cls(**sections[section]) for section, cls in SECTIONS.items()}
    except TypeError as error:  # e.g. an unknown key in a programmatic dict
        raise ConfigError(str(error)) from None
    return Config(**built)


def _missing_model_flags(values: dict) -> list[str]:
    return [flag_name(f.name) for f in dataclasses.fields(ModelConfig)
            if f.default is dataclasses.MISSING and f.name not in values]


# Tokenizers whose vocabulary is their own (NullTokenizer's is --vocab-size; TikTokenizer fills the model's).
FIXED_VOCABULARY_TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer")


def _check_tokenizer_vocab_size(values: dict, model_vocab_size: int) -> None:
    """The tokenizer fits the model's vocabulary (``data.vocab_check``); a smaller one is said once."""
    note = check_tokenizer_fits_model(_tokenizer_vocab_size(values), model_vocab_size,
                                      as_flags({name: values.get(name) for name in TOKENIZER_FIELDS}))
    if note and resolve_launch_env().rank == 0:
        print(f"note: {note}", flush=True)


def _tokenizer_vocab_size(values: dict) -> int:
    """Megatron takes the vocabulary size from the tokenizer when --vocab-size is absent."""
    from megatron_lite.tokenizer import build_tokenizer

    files = {k: values[k] for k in ("vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern",
                                    "tiktoken_num_special_tokens") if k in values}
    return build_tokenizer(values["tokenizer_type"], **files).vocab_size
