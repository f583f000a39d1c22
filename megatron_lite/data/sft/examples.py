"""Fine-tuning examples: records checked and tokenized, or read back from preprocessed indexed datasets.

A record is ``{"prompt": str, "response": str}`` or ``{"messages": [{"role", "content"}, ...]}`` ending with
the assistant's message, or one of the Hugging Face world's shapes and files (``formats``). An example is
its token ids (ending with EOD) and a loss mask over them, 1 where the token is one the loss predicts (a
response token or the EOD; see ``prompt_format``). A bad record (not JSON, a missing or empty response, an
unknown role) is reported as ``file:line`` (``file:row`` in a table).

Preprocessed (``tools/preprocess_data.py --sft``): ``{prefix}_text_document`` holds the ids and
``{prefix}_loss_mask_document`` the masks, one sequence per example with equal lengths;
``{prefix}_prompt_format.json`` records the chat template they were rendered with. Preference pairs
(``--dpo``, ``preference``) are written alike, a pair being one document of two sequences, chosen then rejected.
"""
from __future__ import annotations

import json
import os

import numpy as np

from megatron_lite.config import ConfigError
from megatron_lite.data.indexed_dataset import IndexedDataset, index_file_path, output_prefix_for
from megatron_lite.data.sft.formats import (RecordFormat, SFTDataError, container_of, is_sft_data_source,
                                             parse_record, read_sft_records)
from megatron_lite.data.sft.prompt_format import tokenize_conversation

TOKENS_KEY, LOSS_MASK_KEY = "text", "loss_mask"  # the preprocessed outputs' json-key part of their names
_MAX_LISTED_KINDS = 20  # kinds of mistake listed, one line each
_LISTED_NUMBERS = 5  # line (or row) numbers given for each kind


def split_last_response(messages: list[dict]) -> tuple[list[dict], str]:
    """(the conversation before the last answer, that answer's text): a prompt to generate from and its reference."""
    return messages[:-1], messages[-1]["content"]


def parse_sft_line(line: str, record_format: RecordFormat = RecordFormat()) -> tuple[str, list[dict]]:
    """One record's JSON text -> (its format, its conversation); raises SFTDataError saying what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SFTDataError(f"malformed JSON ({error.msg} at column {error.colno})") from None
    return parse_record(record, record_format)


def _encode(line: str, tokenizer, prompt_format: str, record_format: RecordFormat) -> tuple[str, dict]:
    """(the record's format, {TOKENS_KEY: ids, LOSS_MASK_KEY: mask}); raises ValueError for a bad record."""
    name, messages = parse_sft_line(line, record_format)
    tokens, loss_mask = tokenize_conversation(messages, tokenizer, prompt_format)
    return name, {TOKENS_KEY: tokens, LOSS_MASK_KEY: loss_mask}


def encode_sft_line(line: str, tokenizer, prompt_format: str, record_format: RecordFormat = RecordFormat()):
    """One record's JSON text -> ({TOKENS_KEY: ids, LOSS_MASK_KEY: mask}, None), or (None, problem) for a bad one."""
    try:
        return _encode(line, tokenizer, prompt_format, record_format)[1], None
    except ConfigError:
        raise  # the format or tokenizer is wrong for every line, not this one
    except ValueError as error:  # SFTDataError, or text the tokenizer rejects
        return None, str(error)


def read_conversations(path: str, record_format: RecordFormat = RecordFormat()) -> list[tuple[int, list[dict]]]:
    """(line or row number, conversation) for every record of a file; SFTDataError names every bad one."""
    conversations, problems = [], []
    for _, number, line in records_of(path):
        try:
            conversations.append((number, parse_sft_line(line, record_format)[1]))
        except SFTDataError as error:
            problems.append((path, number, str(error)))
    raise_for_problems(problems, path, found=len(conversations))
    return conversations


def count_sft_examples(paths: list[str], record_format: RecordFormat = RecordFormat()) -> int:
    """The examples of data files and preprocessed prefixes, each data file's records checked as training reads
    them (everything but the tokenizing): a misnamed field fails in seconds, before any model is built."""
    count = 0
    for path in paths:
        if is_preprocessed_sft(path):
            count += len(read_preprocessed(path)[0])
        else:
            count += len(read_conversations(path, record_format))
    return count


def records_of(path: str):
    if not is_sft_data_source(path):
        raise SFTDataError(f"{path} is not a file: give a JSONL, JSON, Parquet or Arrow file of fine-tuning "
                           "examples, a directory written by datasets' save_to_disk, or the --output-prefix of "
                           "tools/preprocess_data.py --sft.")
    return read_sft_records([path])


def read_records(path: str, parse) -> list:
    """``parse(record)`` of every JSON record of ``path``, in order; one SFTDataError names every record that is not
    JSON or that ``parse`` rejects (a ValueError: SFTDataError, or text the tokenizer rejects) as ``file:line``."""
    items, problems = [], []
    for _, number, line in records_of(path):
        try:
            items.append(parse(json.loads(line)))
        except json.JSONDecodeError as error:
            problems.append((path, number, f"malformed JSON ({error.msg} at column {error.colno})"))
        except ConfigError:
            raise  # the template or tokenizer is wrong for every record, not this one
        except ValueError as error:
            problems.append((path, number, str(error)))
    raise_for_problems(problems, path, found=len(items))
    return items


def raise_for_problems(problems: list[tuple[str, int, str]], path: str, *, found: int) -> None:
    """``problems``: (file, line or row, what is wrong). One line per kind of mistake (the same words, in the same
    file), at its first record, with the count and the first few numbers: a misnamed column is one line, not one
    per record."""
    if problems:
        kinds = {}
        for file, number, message in problems:
            kinds.setdefault((file, message), []).append(number)
        listed = "\n".join(_kind_line(file, message, numbers)
                           for (file, message), numbers in list(kinds.items())[:_MAX_LISTED_KINDS])
        more = len(kinds) - _MAX_LISTED_KINDS
        raise SFTDataError(f"{len(problems)} bad line(s) in the fine-tuning data; fix or remove them:\n{listed}"
                           + (f"\n... and {more} more kinds of mistake" if more > 0 else ""))
    if not found:
        raise SFTDataError(f"{path} holds no examples.")


def _kind_line(file: str, message: str, numbers: list[int]) -> str:
    if len(numbers) == 1:
        return f"{file}:{numbers[0]}: {message}"
    unit = "rows" if container_of(file) in ("Parquet", "Arrow", "datasets directory") else "lines"
    shown = ", ".join(map(str, numbers[:_LISTED_NUMBERS])) + (", ..." if len(numbers) > _LISTED_NUMBERS else "")
    return f"{file}:{numbers[0]}: {message} ({len(numbers)} {unit} alike: {shown})"


class SFTExamples:
    """Tokenized examples: ``lengths[i]`` and ``get(i) -> (ids, loss_mask)``, from one or more sources."""

    def __init__(self, sources: list[tuple], descriptions: tuple[str, ...] = ()):
        """``sources``: (ids sequences, mask sequences, lengths) triples, concatenated in order;
        ``descriptions``: what each source was read as, for the start-up summary."""
        self._sources = sources
        self.descriptions = descriptions
        self.lengths = np.concatenate([lengths for _, _, lengths in sources]).astype(np.int64)
        self._starts = np.cumsum([0] + [len(lengths) for _, _, lengths in sources])

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        source = int(np.searchsorted(self._starts, index, side="right")) - 1
        ids, masks, _ = self._sources[source]
        local = index - int(self._starts[source])
        return np.asarray(ids[local], dtype=np.int64), np.asarray(masks[local], dtype=np.uint8)


def load_sft_examples(paths: list[str], tokenizer, prompt_format: str,
                      record_format: RecordFormat = RecordFormat()) -> SFTExamples:
    """Examples from data files (tokenized now) and preprocessed prefixes, in the order given."""
    read = [_read_source(path, tokenizer, prompt_format, record_format) for path in paths]
    return SFTExamples([source for source, _ in read], tuple(description for _, description in read))


def is_preprocessed_sft(path: str) -> bool:
    """Whether ``path`` is the --output-prefix of tools/preprocess_data.py --sft (else it is a data file)."""
    return os.path.isfile(index_file_path(output_prefix_for(path, TOKENS_KEY)))


def _read_source(path: str, tokenizer, prompt_format: str, record_format: RecordFormat) -> tuple[tuple, str]:
    """(ids, masks, lengths) of one source, and what it was read as ("a.json: JSON array of alpaca records")."""
    if is_preprocessed_sft(path):
        check_prompt_format(path, prompt_format)
        tokens, masks = read_preprocessed(path)
        return (tokens, masks, tokens.sequence_lengths), f"{path}: preprocessed"
    ids, masks, problems, formats = [], [], [], {}
    for _, number, line in records_of(path):
        try:
            name, encoded = _encode(line, tokenizer, prompt_format, record_format)
        except ConfigError:
            raise  # the format or tokenizer is wrong for every record, not this one
        except ValueError as error:  # SFTDataError, or text the tokenizer rejects
            problems.append((path, number, str(error)))
            continue
        formats[name] = None  # in order of first appearance
        ids.append(encoded[TOKENS_KEY])
        masks.append(encoded[LOSS_MASK_KEY])
    raise_for_problems(problems, path, found=len(ids))
    description = f"{path}: {container_of(path)} of {' and '.join(formats)} records"
    return (ids, masks, np.asarray([len(x) for x in ids], dtype=np.int64)), description


def prompt_format_file(prefix: str) -> str:
    """The JSON file beside a preprocessed --sft prefix that records its --sft-tokenizer-prompt-format."""
    return f"{prefix}_prompt_format.json"


def write_prompt_format(prefix: str, prompt_format: str) -> None:
    with open(prompt_format_file(prefix), "w") as f:
        json.dump({"sft_tokenizer_prompt_format": prompt_format}, f)


def check_prompt_format(prefix: str, prompt_format: str) -> None:
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


# What a preprocessed prefix holds, by its sequences per document (``read_preprocessed``).
PREPROCESSED_KINDS = {1: ("fine-tuning examples", "--sft"), 2: ("preference pairs", "--dpo")}


def read_preprocessed(prefix: str, sequences_per_document: int = 1) -> tuple[IndexedDataset, IndexedDataset]:
    """(ids, loss masks) of a preprocessed prefix, checked to be written together and to hold
    ``sequences_per_document`` sequences in each document: 1, fine-tuning examples; 2, preference pairs."""
    tokens = IndexedDataset(output_prefix_for(prefix, TOKENS_KEY))
    masks = IndexedDataset(output_prefix_for(prefix, LOSS_MASK_KEY))
    if not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise SFTDataError(f"{output_prefix_for(prefix, TOKENS_KEY)} and {output_prefix_for(prefix, LOSS_MASK_KEY)} "
                           "differ in their examples' lengths: they were not written together. Rerun "
                           "tools/preprocess_data.py --sft.")
    per_document = np.unique(np.diff(tokens.document_indices))
    if not np.array_equal(per_document, [sequences_per_document]):
        wanted, flag = PREPROCESSED_KINDS[sequences_per_document]
        found = PREPROCESSED_KINDS.get(int(per_document[0]), ("other documents",))[0] if len(per_document) == 1 \
            else "documents of different numbers of sequences"
        raise SFTDataError(f"{prefix} holds {found}, but this run reads {wanted}: preprocess its records with "
                           f"tools/preprocess_data.py {flag}, or give data of the run's kind.")
    return tokens, masks
