"""Fine-tuning examples: JSONL records checked and tokenized, or read back from preprocessed indexed datasets.

A line is ``{"prompt": str, "response": str}`` or ``{"messages": [{"role", "content"}, ...]}`` ending with
the assistant's message. An example is its token ids (ending with EOD) and a loss mask over them, 1 where
the token is one the loss predicts (a response token or the EOD; see ``prompt_format``). A bad line (not
JSON, a missing or empty response, an unknown role) is reported as ``file:line``.

Preprocessed (``tools/preprocess_data.py --sft``): ``{prefix}_text_document`` holds the ids and
``{prefix}_loss_mask_document`` the masks, one sequence per example with equal lengths;
``{prefix}_prompt_format.json`` records the chat template they were rendered with.
"""
from __future__ import annotations

import json
import os

import numpy as np

from megatron_lite.config import ConfigError, UserError
from megatron_lite.data.indexed_dataset import IndexedDataset, index_file_path, output_prefix_for
from megatron_lite.data.jsonl import read_jsonl_lines
from megatron_lite.data.sft.prompt_format import ROLES, tokenize_conversation

TOKENS_KEY, LOSS_MASK_KEY = "text", "loss_mask"  # the preprocessed outputs' json-key part of their names
_MAX_LISTED_PROBLEMS = 20


class SFTDataError(UserError, ValueError):
    """Fine-tuning data that cannot be used; the message names the file and line."""


def conversation_of(record) -> list[dict]:
    """The record's messages (a prompt/response pair is a user and an assistant message); raises SFTDataError."""
    if not isinstance(record, dict):
        raise SFTDataError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _checked_messages(record["messages"])
    if "prompt" not in record or "response" not in record:
        raise SFTDataError('needs "prompt" and "response", or "messages"')
    for key in ("prompt", "response"):
        if not isinstance(record[key], str):
            raise SFTDataError(f"{key!r} is {type(record[key]).__name__}, not a string")
    if not record["response"].strip():
        raise SFTDataError("empty response")
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


def _checked_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise SFTDataError('"messages" must be a non-empty list of {"role", "content"} objects')
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise SFTDataError(f"message {number} needs a role among {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise SFTDataError(f"message {number} needs a string content")
        if message["role"] == "assistant" and not message["content"].strip():
            raise SFTDataError(f"empty response (message {number})")
    if messages[-1]["role"] != "assistant":
        raise SFTDataError("the last message must be the assistant's (the response the loss trains on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def split_last_response(messages: list[dict]) -> tuple[list[dict], str]:
    """(the conversation before the last answer, that answer's text): a prompt to generate from and its reference."""
    return messages[:-1], messages[-1]["content"]


def parse_sft_line(line: str) -> list[dict]:
    """One JSONL line -> its conversation; raises SFTDataError saying what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SFTDataError(f"malformed JSON ({error.msg} at column {error.colno})") from None
    return conversation_of(record)


def encode_sft_line(line: str, tokenizer, prompt_format: str):
    """One JSONL line -> ({TOKENS_KEY: ids, LOSS_MASK_KEY: mask}, None), or (None, problem) for a bad line."""
    try:
        tokens, loss_mask = tokenize_conversation(parse_sft_line(line), tokenizer, prompt_format)
    except ConfigError:
        raise  # the format or tokenizer is wrong for every line, not this one
    except ValueError as error:  # SFTDataError, or text the tokenizer rejects
        return None, str(error)
    return {TOKENS_KEY: tokens, LOSS_MASK_KEY: loss_mask}, None


def read_conversations(path: str) -> list[tuple[int, list[dict]]]:
    """(line number, conversation) for every line of a JSONL file; SFTDataError names every bad line."""
    conversations, problems = [], []
    for _, line_number, line in _jsonl_lines(path):
        try:
            conversations.append((line_number, parse_sft_line(line)))
        except SFTDataError as error:
            problems.append(f"{path}:{line_number}: {error}")
    _raise_for(problems, path, found=len(conversations))
    return conversations


def _jsonl_lines(path: str):
    if not os.path.isfile(path):
        raise SFTDataError(f"{path} is not a file: give a JSONL file of fine-tuning examples or the --output-prefix "
                           "of tools/preprocess_data.py --sft.")
    return read_jsonl_lines([path])


def _raise_for(problems: list[str], path: str, *, found: int) -> None:
    if problems:
        listed = "\n".join(problems[:_MAX_LISTED_PROBLEMS])
        more = len(problems) - _MAX_LISTED_PROBLEMS
        raise SFTDataError(f"{len(problems)} bad line(s) in the fine-tuning data; fix or remove them:\n{listed}"
                           + (f"\n... and {more} more" if more > 0 else ""))
    if not found:
        raise SFTDataError(f"{path} holds no examples.")


class SFTExamples:
    """Tokenized examples: ``lengths[i]`` and ``get(i) -> (ids, loss_mask)``, from one or more sources."""

    def __init__(self, sources: list[tuple]):
        """``sources``: (ids sequences, mask sequences, lengths) triples, concatenated in order."""
        self._sources = sources
        self.lengths = np.concatenate([lengths for _, _, lengths in sources]).astype(np.int64)
        self._starts = np.cumsum([0] + [len(lengths) for _, _, lengths in sources])

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        source = int(np.searchsorted(self._starts, index, side="right")) - 1
        ids, masks, _ = self._sources[source]
        local = index - int(self._starts[source])
        return np.asarray(ids[local], dtype=np.int64), np.asarray(masks[local], dtype=np.uint8)


def load_sft_examples(paths: list[str], tokenizer, prompt_format: str) -> SFTExamples:
    """Examples from JSONL files (tokenized now) and preprocessed prefixes, in the order given."""
    return SFTExamples([_read_source(path, tokenizer, prompt_format) for path in paths])


def is_preprocessed_sft(path: str) -> bool:
    """Whether ``path`` is the --output-prefix of tools/preprocess_data.py --sft (else it is a JSONL file)."""
    return os.path.isfile(index_file_path(output_prefix_for(path, TOKENS_KEY)))


def _read_source(path: str, tokenizer, prompt_format: str) -> tuple:
    if is_preprocessed_sft(path):
        _check_prompt_format(path, prompt_format)
        return _read_preprocessed(path)
    ids, masks, problems = [], [], []
    for _, line_number, line in _jsonl_lines(path):
        encoded, problem = encode_sft_line(line, tokenizer, prompt_format)
        if problem is not None:
            problems.append(f"{path}:{line_number}: {problem}")
            continue
        ids.append(encoded[TOKENS_KEY])
        masks.append(encoded[LOSS_MASK_KEY])
    _raise_for(problems, path, found=len(ids))
    return ids, masks, np.asarray([len(x) for x in ids], dtype=np.int64)


def prompt_format_file(prefix: str) -> str:
    """The JSON file beside a preprocessed --sft prefix that records its --sft-tokenizer-prompt-format."""
    return f"{prefix}_prompt_format.json"


def write_prompt_format(prefix: str, prompt_format: str) -> None:
    with open(prompt_format_file(prefix), "w") as f:
        json.dump({"sft_tokenizer_prompt_format": prompt_format}, f)


def _check_prompt_format(prefix: str, prompt_format: str) -> None:
    """The template baked into preprocessed ids must be the run's: the run saves it in its checkpoints, and
    generation renders prompts with it. Data preprocessed before the record existed is not checked."""
    path = prompt_format_file(prefix)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        recorded = json.load(f)["sft_tokenizer_prompt_format"]
    if recorded != prompt_format:
        raise ConfigError(f"{prefix} was preprocessed with --sft-tokenizer-prompt-format {recorded}, but this run's "
                          f"is {prompt_format}: give --sft-tokenizer-prompt-format {recorded} (or preprocess the "
                          f"data again with {prompt_format}).")


def _read_preprocessed(prefix: str) -> tuple:
    tokens = IndexedDataset(output_prefix_for(prefix, TOKENS_KEY))
    masks = IndexedDataset(output_prefix_for(prefix, LOSS_MASK_KEY))
    if not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise SFTDataError(f"{output_prefix_for(prefix, TOKENS_KEY)} and {output_prefix_for(prefix, LOSS_MASK_KEY)} "
                           "differ in their examples' lengths: they were not written together. Rerun "
                           "tools/preprocess_data.py --sft.")
    return tokens, masks, tokens.sequence_lengths
