"""How a config field is a command-line flag, and the checks every section's ``__post_init__`` makes.

A field ``norm_epsilon`` is the flag ``--norm-epsilon`` (a field that defaults to True is turned off by a
negative flag, Megatron's spelling); its ``choices`` metadata is what the parser offers and what ``check_choices``
accepts, so a section built in code is checked as one parsed from flags.
"""
from __future__ import annotations

import dataclasses

from megatron_lite.config.errors import ConfigError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_choices(section) -> None:
    """Each field whose metadata lists ``choices`` holds one of them (every element, for a list field); the
    parser offers the same list. None passes where it is the field's default ("not given")."""
    for f in dataclasses.fields(section):
        choices, value = f.metadata.get("choices"), getattr(section, f.name)
        if choices is None or (value is None and f.default is None):
            continue
        bad = [v for v in (value if isinstance(value, list) else [value]) if v not in choices]
        require(not bad, f"{flag_name(f.name)} must be one of {', '.join(map(str, choices))}, "
                          f"got {', '.join(map(repr, bad))}.")


# Fields that default to True are turned off by these flags (Megatron's spelling).
NEGATIVE_FLAGS = {"add_bias_linear": "--disable-bias-linear", "use_fused_kernels": "--no-fused-kernels",
                  "log_memory": "--no-log-memory", "mmap_bin_files": "--no-mmap-bin-files",
                  "muon_split_qkv": "--muon-no-split-qkv",
                  "manual_gc_eval": "--no-manual-gc-eval",
                  "check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
                  "yarn_correction_range_round_to_int": "--no-yarn-correction-range-round-to-int"}


def flag_name(field_name: str) -> str:
    """The command-line flag that sets a config field: ``norm_epsilon`` -> ``--norm-epsilon``."""
    return NEGATIVE_FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def flag_is_on(field_name: str, value: bool) -> bool:
    """Whether a boolean field's flag is given: ``--disable-bias-linear`` is on when add_bias_linear is False."""
    return value != (field_name in NEGATIVE_FLAGS)


def as_flags(values: dict) -> str:
    """Field values as the command line that sets them (switches only when on)."""
    parts = []
    for name, value in values.items():
        if isinstance(value, bool):
            parts += [flag_name(name)] if flag_is_on(name, value) else []
        elif isinstance(value, list):
            parts += [flag_name(name), *map(str, value)]
        elif value is not None:
            parts += [flag_name(name), str(value)]
    return " ".join(parts)

