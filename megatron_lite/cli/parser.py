"""argparse that raises ConfigError instead of printing the usage block and exiting.

Every command (the trainer, generation, evaluation, the tools) parses with it, so a mistyped
flag is one ``error:`` line naming the nearest known flag.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from megatron_lite.config import ConfigError


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
        nearest = nearest_name(name, self._option_string_actions)
        hint = f" (did you mean {nearest}?)" if nearest else "; see --help for the flags megatron_lite knows"
        return f"unrecognized argument {name}{hint}"


def nearest_name(name: str, known) -> str | None:
    """The one of the ``known`` names a mistyped ``name`` most likely meant (a flag, a DeepSpeed key), or None
    when none is close."""
    nearest = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return nearest[0] if nearest else None
