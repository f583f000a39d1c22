"""--grpo's reward functions: loaded from ``FILE.py:NAME`` and called as TRL's GRPOTrainer calls them.

    f(prompts=[...], completions=[...], completion_ids=[...], **columns) -> [float, ...]

one entry per completion: ``prompts`` repeats each prompt once per completion of it (a string, or TRL's
message list for a conversational prompt), ``completions`` the sampled texts (a conversational prompt's as
``[{"role": "assistant", "content": text}]``), ``completion_ids`` their token ids, and each other field of the
prompt records (a reference answer, say) comes as a keyword argument of the same length.

A function that raises, returns the wrong number of rewards, or a reward that is not a finite number (None,
NaN) stops the run with a ``RewardError`` naming the function and the prompt, before the batch trains.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import os

import torch

from megatron_lite.config import ConfigError, UserError

_SHOWN_CHARACTERS = 200  # of a prompt or completion in an error message


class RewardError(UserError):
    """A reward function failed on the run's completions; the message names it and the prompt."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    name: str  # FILE.py:NAME, as given
    function: object

    def __call__(self, prompts: list, completions: list, completion_ids: list, columns: dict) -> list:
        return self.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)


def load_reward_functions(entries: list[str]) -> list[RewardFunction]:
    """Each ``FILE.py:NAME`` imported; a missing file or name is a ConfigError naming the flag."""
    return [RewardFunction(entry, _load(entry, index)) for index, entry in enumerate(entries)]


def _load(entry: str, index: int):
    path, _, name = entry.rpartition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--reward-function {entry}: {path} is not a file (give FILE.py:NAME, the Python file "
                          f"and the function in it).")
    spec = importlib.util.spec_from_file_location(f"megatron_lite_reward_{index}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file: say which, and what it raised
        raise ConfigError(f"--reward-function {entry}: importing {path} raised {type(error).__name__}: "
                          f"{error}") from error
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(n for n, value in vars(module).items() if inspect.isfunction(value) and not n.startswith("_"))
        raise ConfigError(f"--reward-function {entry}: {path} defines no function {name!r} (its functions: "
                          f"{', '.join(defined) or 'none'}).")
    return function


def score(functions: list[RewardFunction], prompts: list, completions: list, completion_ids: list,
          columns: dict) -> torch.Tensor:
    """[completions, functions] rewards, every one checked (module docstring)."""
    scores = [_checked(function, prompts, completions, completion_ids, columns) for function in functions]
    return torch.tensor(scores, dtype=torch.float32).t().contiguous()


def _checked(function: RewardFunction, prompts, completions, completion_ids, columns) -> list[float]:
    try:
        rewards = list(function(prompts, completions, completion_ids, columns))
    except Exception as error:  # noqa: BLE001 - the user's code: name it and the prompt it failed on
        index = _first_failing(function, prompts, completions, completion_ids, columns)
        raise RewardError(f"reward function {function.name} raised {type(error).__name__}: {error}, scoring the "
                          f"completion {_shown(completions[index])} of the prompt {_shown(prompts[index])}; fix the "
                          f"function (it is called as f(prompts=..., completions=..., completion_ids=..., "
                          f"**columns), one reward per completion).") from error
    if len(rewards) != len(completions):
        raise RewardError(f"reward function {function.name} returned {len(rewards)} rewards for {len(completions)} "
                          f"completions (the first of the prompt {_shown(prompts[0])}): it must return one float per "
                          f"completion, in order.")
    for index, reward in enumerate(rewards):
        if not _is_finite_number(reward):
            raise RewardError(f"reward function {function.name} returned {reward!r} for the completion "
                              f"{_shown(completions[index])} of the prompt {_shown(prompts[index])}: every reward "
                              f"must be a finite number.")
    return [float(reward) for reward in rewards]


def _first_failing(function: RewardFunction, prompts, completions, completion_ids, columns) -> int:
    """The first completion the function raises on alone (the first of all, if none does)."""
    for index in range(len(completions)):
        try:
            function(prompts[index:index + 1], completions[index:index + 1], completion_ids[index:index + 1],
                     {key: values[index:index + 1] for key, values in columns.items()})
        except Exception:  # noqa: BLE001 - looking for the one it fails on
            return index
    return 0


def _is_finite_number(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARACTERS else text[:_SHOWN_CHARACTERS] + "...'"
