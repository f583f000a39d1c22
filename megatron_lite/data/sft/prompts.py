"""Prompts for --grpo: records read and tokenized, and the prompts of each batch of completions.

Records, in TRL's prompt-only formats (files as for fine-tuning: JSONL, JSON array, Parquet, Arrow):
    standard         ``{"prompt": str, ...}``: the prompt is the user's turn;
    conversational   ``{"prompt": [messages], ...}`` or ``{"messages": [messages], ...}``: the conversation so
                     far, ending with a user (or system) message.
The chat template (``prompt_format``) renders the prompt with the opening of the assistant's turn, as
generation after fine-tuning does. A record's other fields (a reference answer, say) are handed to the reward
functions as TRL hands a dataset's other columns, one list per field.

Batch k of completions holds prompts k x P .. (k + 1) x P - 1 (P = prompts per batch) of an order that
changes every epoch (``EpochLayout``), and data-parallel rank r samples the r-th slice of them: a prompt's
place in the run does not depend on the layout.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from megatron_lite.data.sft.examples import read_records
from megatron_lite.data.sft.formats import SFTDataError, checked_messages
from megatron_lite.data.sft.prompt_format import format_prompt
from megatron_lite.data.sft.sft_dataset import EpochLayout

PROMPT_KEYS = ("prompt", "messages")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One record: its prompt as the reward functions see it (TRL's: the string, or the message list), its
    conversation, its other fields, and the ids generation starts from (after ``tokenize``)."""
    prompt: str | list
    messages: list
    columns: dict
    ids: tuple = ()

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def parse_prompt_record(record) -> Prompt:
    """A record's prompt and other fields; raises SFTDataError saying what is wrong."""
    if not isinstance(record, dict):
        raise SFTDataError(f"expected a JSON object, got {type(record).__name__}")
    keys = [key for key in PROMPT_KEYS if key in record]
    if len(keys) != 1:
        raise SFTDataError(f'a --grpo record needs "prompt" (a string or message list) or "messages" (a message '
                           f'list), one of them; this one has keys {sorted(record)}')
    prompt = record[keys[0]]
    columns = {key: value for key, value in record.items() if key != keys[0]}
    if isinstance(prompt, str) and keys[0] == "prompt":
        if not prompt.strip():
            raise SFTDataError('empty "prompt"')
        return Prompt(prompt, [{"role": "user", "content": prompt}], columns)
    messages = checked_messages(prompt, f'"{keys[0]}"', ends_with_answer=False)
    if messages[-1]["role"] == "assistant":
        raise SFTDataError(f'"{keys[0]}" ends with the assistant\'s message: a prompt is the conversation before '
                           f'the answer the policy samples')
    return Prompt(messages, messages, columns)


class PromptDataset:
    """The tokenized prompts, and which of them each batch of completions samples (module docstring)."""

    def __init__(self, prompts: list[Prompt], *, seed: int, num_batches: int, prompts_per_batch: int,
                 descriptions: tuple[str, ...] = ()):
        self.prompts, self.prompts_per_batch, self.descriptions = prompts, prompts_per_batch, descriptions
        self.layout = EpochLayout(np.ones(len(prompts), dtype=np.int64), num_samples=num_batches * prompts_per_batch,
                                  seed=seed)

    def __len__(self) -> int:
        return len(self.prompts)

    def batch(self, index: int, data_parallel_rank: int, data_parallel_size: int) -> list[tuple[int, Prompt]]:
        """(place in the run, prompt) of this rank's share of batch ``index``; the place seeds its sampling."""
        share = self.prompts_per_batch // data_parallel_size
        first = index * self.prompts_per_batch + data_parallel_rank * share
        return [(place, self.prompts[int(self.layout.members(place)[0])]) for place in range(first, first + share)]

    @property
    def longest(self) -> int:
        return max(len(prompt.ids) for prompt in self.prompts)

    def describe(self) -> str:
        return (f"{len(self.prompts)} prompts ({self.prompts_per_batch} per batch of completions, the longest "
                f"{self.longest} tokens)" + "".join(f"; {d}" for d in self.descriptions))


def load_prompts(paths: list[str], tokenizer, prompt_format: str) -> tuple[list[Prompt], tuple[str, ...]]:
    """Tokenized prompts of data files, in order, and what each file held; every bad record named ``file:line``."""
    prompts, descriptions = [], []
    for path in paths:
        read = _read_prompts(path, tokenize=lambda prompt: dataclasses.replace(
            prompt, ids=tuple(format_prompt(prompt.messages, tokenizer, prompt_format))))
        prompts += read
        descriptions.append(f"{path}: {len(read)} prompts")
    return prompts, tuple(descriptions)


def count_prompts(paths: list[str]) -> int:
    """The prompts of data files, each record checked as training reads it (all but the tokenizing)."""
    return sum(len(_read_prompts(path)) for path in paths)


def _read_prompts(path: str, tokenize=None) -> list[Prompt]:
    if tokenize is None:
        return read_records(path, parse_prompt_record)
    return read_records(path, lambda record: tokenize(parse_prompt_record(record)))
