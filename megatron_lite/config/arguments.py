"""Command line -> Config, with Megatron-LM's flag names.

Flags are generated from the config dataclasses' fields (``micro_batch_size`` ->
``--micro-batch-size``), so every option is reachable and named as in Megatron-LM.
Booleans that default to True are switched off with Megatron's negative spelling
(``--disable-bias-linear``, ``--no-fused-kernels``). Unknown flags are an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing

from megatron_lite.config import SECTIONS, Config, ConfigError, ModelConfig

# Fields that default to True are turned off by these flags (Megatron's spelling).
NEGATIVE_FLAGS = {"add_bias_linear": "--disable-bias-linear", "use_fused_kernels": "--no-fused-kernels",
                  "log_memory": "--no-log-memory"}
LIST_FIELDS = {"data_path"}
# Megatron-LM spells these two with an underscore inside; both spellings are accepted.
MEGATRON_SPELLINGS = {"override_opt_param_scheduler": "--override-opt_param-scheduler",
                      "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(hint):
    """int for Optional[int], and so on."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _default_text(f: dataclasses.Field) -> str | None:
    """'(default: X)' for --help; required flags and derived defaults (None) say nothing."""
    if f.default is dataclasses.MISSING or f.default is None or isinstance(f.default, bool):
        return None
    return f"(default: {f.default})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing the usage block and exiting.

    Under torchrun every rank parses the flags; the usage block from each of them would
    bury the one line that says what is wrong. An unknown flag names its nearest known one.
    """

    def error(self, message: str):
        raise ConfigError(f"{message}; see --help.")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ConfigError("; ".join(self._unknown_flag_message(flag) for flag in unknown
                                        if flag.startswith("-")) or f"unexpected arguments: {' '.join(unknown)}")
        return parsed

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
            common = dict(dest=f.name, default=argparse.SUPPRESS, help=_default_text(f))
            if f.name in LIST_FIELDS:
                group.add_argument(_flag(f.name), nargs="+", **common)
            elif kind is bool and f.default is True:
                group.add_argument(NEGATIVE_FLAGS[f.name], action="store_false", **common)
            elif kind is bool:
                spellings = [MEGATRON_SPELLINGS[f.name]] if f.name in MEGATRON_SPELLINGS else []
                group.add_argument(*spellings, _flag(f.name), action="store_true", **common)
            else:
                group.add_argument(_flag(f.name), type=kind, **common)
    parser.add_argument("--group-query-attention", action="store_true",
                        help="use --num-query-groups key/value heads (grouped-query attention)")
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse Megatron-style flags; raises ConfigError (naming the flag) on bad values."""
    namespace = vars(build_parser().parse_args(argv))
    if "num_query_groups" in namespace and not namespace.pop("group_query_attention"):
        raise ConfigError("--num-query-groups needs --group-query-attention (as in Megatron-LM); add the flag.")
    namespace.pop("group_query_attention", None)
    return config_from_dict(namespace)


def config_from_dict(values: dict) -> Config:
    """Distribute flat field values into the config sections and validate them."""
    sections = {}
    for section, cls in SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        sections[section] = {k: v for k, v in values.items() if k in names}
    if "vocab_size" not in sections["model"] and values.get("tokenizer_type"):
        sections["model"]["vocab_size"] = _tokenizer_vocab_size(values)
    if "vocab_size" not in sections["model"]:
        raise ConfigError("no vocabulary: give --tokenizer-type and its files (e.g. --tokenizer-type GPT2BPETokenizer "
                          "--vocab-file vocab.json --merge-file merges.txt, or SentencePieceTokenizer / "
                          "HuggingFaceTokenizer with --tokenizer-model), or --vocab-size N for --mock-data.")
    missing = [_flag(f.name) for f in dataclasses.fields(ModelConfig)
               if f.default is dataclasses.MISSING and f.name not in sections["model"]]
    if missing:
        raise ConfigError(f"missing required model flags: {' '.join(missing)}.")
    try:
        built = {section: cls(**sections[section]) for section, cls in SECTIONS.items()}
    except TypeError as error:  # e.g. an unknown key in a programmatic dict
        raise ConfigError(str(error)) from None
    return Config(**built)


def _tokenizer_vocab_size(values: dict) -> int:
    """Megatron takes the vocabulary size from the tokenizer when --vocab-size is absent."""
    from megatron_lite.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(values["tokenizer_type"], vocab_file=values.get("vocab_file"),
                                merge_file=values.get("merge_file"), tokenizer_model=values.get("tokenizer_model"))
    return tokenizer.vocab_size
