"""Command line -> Config, with Megatron-LM's flag names.

Flags are generated from the config dataclasses' fields (``micro_batch_size`` ->
``--micro-batch-size``), so every option is reachable and named as in Megatron-LM; a field's
``choices`` metadata are its flag's choices, and its line in ``config/help_text.py`` its help.
Booleans that default to True are switched off with Megatron's negative spelling
(``--disable-bias-linear``, ``--no-fused-kernels``). ``--use-checkpoint-args`` fills the
model flags from the checkpoint to be loaded; a run resumed from --load keeps its checkpoint's
tokenizer when the command line names none (``checkpoint_args``). Megatron-LM flags with no setting
here are accepted as no-ops or refused by name (``megatron_compat``); any other unknown flag is an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from megatron_lite.cli import deepspeed_config, megatron_compat
from megatron_lite.cli.checkpoint_args import (checkpoint_model_args, megatron_checkpoints_imported,
                                               resumed_run_tokenizer_args)
from megatron_lite.checkpointing.sft_prompt_format import prompt_format_from_checkpoint
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.config import (DEFAULT_TRAIN_ITERS, RUN_LENGTH_FIELDS, SECTIONS, Config, ConfigError, as_flags,
                                  flag_name, missing_model_flags, section_values)
from megatron_lite.config.help_text import HELP
from megatron_lite.data.vocab_check import check_tokenizer_fits_model
from megatron_lite.process_groups.initialize import resolve_launch_env
from megatron_lite.tokenizer import TOKENIZER_FIELDS, build_tokenizer

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
                                   choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"),
                                   action=f.metadata.get("action", "store"), **common)
            elif kind is bool and f.default is True:
                group.add_argument(flag_name(f.name), action="store_false", **common)
            elif kind is bool:
                spellings = [MEGATRON_SPELLINGS[f.name]] if f.name in MEGATRON_SPELLINGS else []
                group.add_argument(*spellings, flag_name(f.name), action="store_true", **common)
            else:
                group.add_argument(flag_name(f.name), type=kind, choices=f.metadata.get("choices"), **common)
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
    namespace, deepspeed_notices, json_keys = deepspeed_config.translate_deepspeed_flags(
        namespace, resolve_launch_env().world_size)
    notices += deepspeed_notices
    if not any(name in namespace for name in RUN_LENGTH_FIELDS):  # Megatron-LM would require one
        notices.append(f"no --train-iters, --train-samples or --train-epochs: the run is {DEFAULT_TRAIN_ITERS} "
                       f"iterations, the default.")
    if resolve_launch_env().rank == 0:  # once per job under torchrun, not once per rank
        for notice in notices:
            print(f"note: {notice}", flush=True)
    with deepspeed_config.errors_name_json_keys(json_keys):
        return config_from_namespace(namespace)


def config_from_namespace(namespace: dict) -> Config:
    """Parsed flags (by field name, as ``build_parser`` leaves them) -> Config, with
    --group-query-attention checked, a Megatron-LM checkpoint imported, --use-checkpoint-args applied, a resumed
    run's tokenizer kept and a fine-tuned checkpoint's chat template kept (``sft_prompt_format``)."""
    if "num_query_groups" in namespace and not namespace.pop("group_query_attention"):
        raise ConfigError("--num-query-groups needs --group-query-attention (as in Megatron-LM); add the flag.")
    namespace.pop("group_query_attention", None)
    namespace.update(megatron_checkpoints_imported(namespace))
    if namespace.get("use_checkpoint_args"):
        namespace.update(checkpoint_model_args(namespace))
    else:
        namespace.update(resumed_run_tokenizer_args(namespace))
    taken = prompt_format_from_checkpoint(namespace)
    if taken and resolve_launch_env().rank == 0:
        print(f"note: fine-tuning on with the checkpoint's chat template: {as_flags(taken)}", flush=True)
    namespace.update(taken)
    return config_from_dict(namespace)


def config_from_dict(values: dict) -> Config:
    """Distribute flat field values into the config sections and validate them."""
    sections = {section: section_values(values, cls) for section, cls in SECTIONS.items()}
    if "vocab_size" in sections["model"] and values.get("tokenizer_type") in FIXED_VOCABULARY_TOKENIZERS:
        _check_tokenizer_vocab_size(values, sections["model"]["vocab_size"])
    if "vocab_size" not in sections["model"] and values.get("tokenizer_type"):
        sections["model"]["vocab_size"] = _tokenizer_vocab_size(values)
    if "vocab_size" not in sections["model"]:
        raise ConfigError("no vocabulary: give --tokenizer-type and its files (e.g. --tokenizer-type GPT2BPETokenizer "
                          "--vocab-file vocab.json --merge-file merges.txt, or SentencePieceTokenizer / "
                          "HuggingFaceTokenizer with --tokenizer-model), or --vocab-size N for --mock-data.")
    missing = missing_model_flags(sections["model"])
    if missing:
        raise ConfigError(f"missing required model flags: {' '.join(missing)}.")
    try:
        built = {section: cls(**sections[section]) for section, cls in SECTIONS.items()}
    except TypeError as error:  # e.g. an unknown key in a programmatic dict
        raise ConfigError(str(error)) from None
    return Config(**built)


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
    files = {k: values[k] for k in ("vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern",
                                    "tiktoken_num_special_tokens") if k in values}
    return build_tokenizer(values["tokenizer_type"], **files).vocab_size
