"""Fine-tuning data as it comes from the Hugging Face world: which file holds the records, and each record's shape.

Files, told apart per file (see docs/coming_from_hf_and_deepspeed.md):
    JSONL            one record per line (any extension);
    JSON array       ``[{...}, {...}]`` in one file (a downloaded ``.json`` set);
    Parquet          ``.parquet`` (the Hub's files);
    Arrow            ``.arrow``, the IPC stream or file format (what ``datasets`` writes);
    datasets dir     a directory written by ``datasets.Dataset.save_to_disk`` (its ``state.json`` lists the
                     ``.arrow`` shards).
Tables are read with pyarrow, the one optional import here (``pip install "megatron_lite[hf]"``).

Records, told apart per record (``--sft-format`` forces one shape for all):
    prompt_response  ``{"prompt", "response"}``
    messages         ``{"messages": [{"role", "content"}, ...]}``
    alpaca           ``{"instruction", "input"?, "output", "system"?, "history"?: [[prompt, response], ...]}``
    sharegpt         ``{"conversations": [{"from": "system|human|gpt", "value"}, ...], "system"?}``
                     (messages in either format take ``from``/``value`` or ``role``/``content``)
``--sft-data-keys NAME=COLUMN`` reads a column under one of the names above (``prompt=question``).

A record is numbered by its line in a text file and by its row (from 1) in a table, so a bad one is
named ``file:N`` either way. Every source yields the record as JSON text, which the preprocessing
workers parse as they parse JSONL lines.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from megatron_lite.config import SFT_FORMATS, UserError, check_sft_data_keys
from megatron_lite.config.help_text import HELP
from megatron_lite.data.jsonl import read_jsonl_lines
from megatron_lite.data.sft.prompt_format import ROLES

# ShareGPT's speakers (LLaMA-Factory's defaults) by the role they play here.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant"}
_ROWS_PER_BATCH = 1024


class SFTDataError(UserError, ValueError):
    """Fine-tuning data that cannot be used; the message names the file and line (or row)."""


@dataclass(frozen=True)
class RecordFormat:
    """How records are read: ``name`` one of SFT_FORMATS ("auto": per record), ``keys`` NAME -> COLUMN renames."""

    name: str = "auto"
    keys: tuple = field(default=())  # (NAME, COLUMN) pairs; a tuple so the format pickles and hashes

    @classmethod
    def from_flags(cls, sft_format: str, sft_data_keys: list[str]) -> "RecordFormat":
        """--sft-format and --sft-data-keys NAME=COLUMN ...; raises ConfigError for a bad entry."""
        check_sft_data_keys(sft_data_keys)
        return cls(name=sft_format, keys=tuple(tuple(entry.split("=", 1)) for entry in sft_data_keys))


def add_record_format_arguments(group) -> None:
    """--sft-format and --sft-data-keys for a tool with its own parser; training's are DataConfig fields."""
    group.add_argument("--sft-format", choices=SFT_FORMATS, default="auto", help=HELP["sft_format"])
    group.add_argument("--sft-data-keys", nargs="+", default=[], metavar="NAME=COLUMN", help=HELP["sft_data_keys"])


def conversation_of(record, record_format: RecordFormat = RecordFormat()) -> list[dict]:
    """The record's messages, ending with the assistant's; raises SFTDataError saying what is wrong."""
    return parse_record(record, record_format)[1]


def parse_record(record, record_format: RecordFormat = RecordFormat()) -> tuple[str, list[dict]]:
    """(the record's format, its messages); raises SFTDataError."""
    if not isinstance(record, dict):
        raise SFTDataError(f"expected a JSON object, got {type(record).__name__}")
    record = _renamed(record, record_format.keys)
    name = record_format.name if record_format.name != "auto" else _detected_format(record)
    return name, _READERS[name](record)


def _renamed(record: dict, keys: tuple) -> dict:
    if not keys:
        return record
    renamed = dict(record)
    for name, column in keys:
        if column in record:
            renamed[name] = renamed.pop(column)
    return renamed


def _detected_format(record: dict) -> str:
    for key, name in (("messages", "messages"), ("conversations", "sharegpt"), ("instruction", "alpaca"),
                      ("prompt", "prompt_response"), ("response", "prompt_response")):
        if key in record:
            return name
    raise SFTDataError(f'needs "prompt" and "response", or "messages" (or Alpaca\'s "instruction" and "output", or '
                       f'ShareGPT\'s "conversations"); the record has keys {sorted(record)}: rename columns with '
                       f'--sft-data-keys NAME=COLUMN')


def _prompt_response(record: dict) -> list[dict]:
    _require_strings(record, ("prompt", "response"), 'needs "prompt" and "response", or "messages"')
    return [{"role": "user", "content": record["prompt"]}, _answer(record["response"])]


def _alpaca(record: dict) -> list[dict]:
    """instruction + input is the prompt, as LLaMA-Factory joins them (a newline between)."""
    _require_strings(record, ("instruction", "output"), 'Alpaca needs "instruction" and "output"')
    prompt = record["instruction"]
    if record.get("input"):
        _require_strings(record, ("input",), "")
        prompt += "\n" + record["input"]
    messages = _system(record)
    history = record.get("history") or []
    if not isinstance(history, list) or not all(isinstance(turn, (list, tuple)) and len(turn) == 2
                                                and all(isinstance(t, str) for t in turn) for turn in history):
        raise SFTDataError('Alpaca "history" must be a list of [prompt, response] string pairs')
    for past_prompt, past_response in history:
        messages += [{"role": "user", "content": past_prompt}, {"role": "assistant", "content": past_response}]
    return messages + [{"role": "user", "content": prompt}, _answer(record["output"])]


def _messages(record: dict) -> list[dict]:
    return checked_messages(record["messages"], '"messages"')


def _sharegpt(record: dict) -> list[dict]:
    return _system(record) + checked_messages(record["conversations"], '"conversations"')


def _system(record: dict) -> list[dict]:
    """A record's separate system prompt (Alpaca's and LLaMA-Factory's ShareGPT "system" column)."""
    if not record.get("system"):
        return []
    _require_strings(record, ("system",), "")
    return [{"role": "system", "content": record["system"]}]


def checked_messages(messages, key: str, *, ends_with_answer: bool = True) -> list[dict]:
    """The messages under ``key``, each checked; the last must be the assistant's unless ``ends_with_answer``
    is False (a preference record's prompt)."""
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(f'{key} must be a non-empty list of {{"role", "content"}} (or ShareGPT\'s '
                           f'{{"from", "value"}}) objects')
    checked = [_message(number, message) for number, message in enumerate(messages, start=1)]
    if ends_with_answer and checked[-1]["role"] != "assistant":
        raise SFTDataError("the last message must be the assistant's (the response the loss trains on)")
    return checked


def _message(number: int, message) -> dict:
    sharegpt = isinstance(message, dict) and "from" in message
    role = message.get("from" if sharegpt else "role") if isinstance(message, dict) else None
    content = message.get("value" if sharegpt else "content") if isinstance(message, dict) else None
    if (SHAREGPT_ROLES.get(role) if sharegpt else role if role in ROLES else None) is None:
        among = ", ".join(SHAREGPT_ROLES) if sharegpt else ", ".join(ROLES)
        raise SFTDataError(f"message {number} needs a role among {among}, got {role!r}")
    if not isinstance(content, str):
        raise SFTDataError(f"message {number} needs a string content")
    role = SHAREGPT_ROLES[role] if sharegpt else role
    if role == "assistant" and not content.strip():
        raise SFTDataError(f"empty response (message {number})")
    return {"role": role, "content": content}


def _require_strings(record: dict, keys: tuple, missing: str) -> None:
    for key in keys:
        if key not in record:
            raise SFTDataError(f"{missing}; the record has keys {sorted(record)} (--sft-data-keys renames columns)")
        if not isinstance(record[key], str):
            raise SFTDataError(f"{key!r} is {type(record[key]).__name__}, not a string")


def _answer(text: str) -> dict:
    if not text.strip():
        raise SFTDataError("empty response")
    return {"role": "assistant", "content": text}


_READERS = {"prompt_response": _prompt_response, "messages": _messages, "alpaca": _alpaca, "sharegpt": _sharegpt}


# Files.

def container_of(path: str) -> str:
    """What holds the records at ``path``: JSONL, JSON array, Parquet, Arrow or datasets directory."""
    if os.path.isdir(path):
        return "datasets directory"
    if path.endswith(".parquet"):
        return "Parquet"
    if path.endswith(".arrow"):
        return "Arrow"
    with open(path, "rb") as f:
        start = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 byte-order mark, then blanks
    return "JSON array" if start.startswith(b"[") else "JSONL"


def read_sft_records(paths: list[str]):
    """(file index, line or row number, the record as JSON text) for every record of the files, in order."""
    for file_index, path in enumerate(paths):
        container = container_of(path)
        if container == "JSONL":
            records = ((number, line) for _, number, line in read_jsonl_lines([path]))
        elif container == "JSON array":
            records = _json_array_records(path)
        else:
            records = _table_records(path, container)
        for number, text in records:
            yield file_index, number, text


def _json_array_records(path: str):
    """Each element of a JSON array file as its own text, numbered by the line it starts on."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SFTDataError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {error.start}); re-encode the "
                           "file as UTF-8") from None
    decoder = json.JSONDecoder()
    position, line = _skip_blanks(text, text.index("[") + 1, 1 + text.count("\n", 0, text.index("[")))
    while not text.startswith("]", position):
        if position == len(text):
            raise SFTDataError(f"{path}:{line}: the JSON array ends before its closing ']'")
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise SFTDataError(f"{path}:{error.lineno}: malformed JSON array ({error.msg} at column "
                               f"{error.colno}); no example of the file is read") from None
        yield line, text[position:end]
        position, line = _skip_blanks(text, end, line + text.count("\n", position, end))
        if text.startswith(",", position):
            position, line = _skip_blanks(text, position + 1, line)
        elif not text.startswith("]", position):
            raise SFTDataError(f"{path}:{line}: malformed JSON array (expected ',' or ']' after an element)")


def _skip_blanks(text: str, position: int, line: int) -> tuple[int, int]:
    """The first non-blank position from ``position`` on, and its line."""
    end = position
    while end < len(text) and text[end] in " \t\r\n":
        end += 1
    return end, line + text.count("\n", position, end)


def _table_records(path: str, container: str):
    """Rows of a Parquet or Arrow file, or of a datasets directory's shards, numbered from 1."""
    number = 0
    for batch in _table_batches(path, container):
        for row in batch.to_pylist():
            number += 1
            yield number, json.dumps(row, default=str)  # a date or bytes column: as text, never a crash


def _table_batches(path: str, container: str):
    pyarrow = _pyarrow(path)
    if container == "Parquet":
        import pyarrow.parquet
        yield from pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=_ROWS_PER_BATCH)
    elif container == "Arrow":
        yield from _arrow_batches(pyarrow, path)
    else:
        for shard in _datasets_shards(path):
            yield from _arrow_batches(pyarrow, shard)


def _arrow_batches(pyarrow, path: str):
    """datasets writes the IPC stream format; pyarrow's Feather/IPC file format is read too."""
    import pyarrow.ipc
    try:
        reader = pyarrow.ipc.open_stream(pyarrow.memory_map(path))
    except pyarrow.ArrowInvalid:
        reader = pyarrow.ipc.open_file(pyarrow.memory_map(path))
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        return
    yield from reader


def _datasets_shards(directory: str) -> list[str]:
    state = os.path.join(directory, "state.json")
    if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
        raise SFTDataError(f"{directory} holds a DatasetDict (several splits): give one split's directory, e.g. "
                           f"{os.path.join(directory, 'train')}")
    if not os.path.isfile(state):
        raise SFTDataError(f"{directory} is a directory without state.json, so not one written by datasets' "
                           "save_to_disk: give a JSONL, JSON, Parquet or Arrow file, or such a directory")
    with open(state) as f:
        files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    return [os.path.join(directory, name) for name in files]


def _pyarrow(path: str):
    try:
        import pyarrow
    except ImportError:
        raise SFTDataError(f"reading {path} needs pyarrow: pip install \"megatron_lite[hf]\" (or pip install "
                           "pyarrow), or convert the data to JSONL") from None
    return pyarrow


def is_sft_data_source(path: str) -> bool:
    """A file, or a directory written by save_to_disk (its content is checked when read)."""
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, "state.json")) or \
        os.path.isfile(os.path.join(path, "dataset_dict.json"))
