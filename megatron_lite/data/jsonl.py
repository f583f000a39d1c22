"""Reading JSONL input line by line, keeping each line's place so a bad one can be named ``file:line``."""
from __future__ import annotations

from megatron_lite.config import UserError


class JSONLEncodingError(UserError, ValueError):
    """A line of a JSONL file is not UTF-8 text (a binary file, or another encoding)."""


def read_jsonl_lines(input_paths: list[str]):
    """(file index, line number from 1, line) for every non-blank line of the files, in order.

    Lines are decoded one by one, so bytes that are not UTF-8 are reported with their line and their
    offset in the file (Python's own error gives only the offset inside its read buffer)."""
    for file_index, path in enumerate(input_paths):
        with open(path, "rb") as f:
            offset = 0
            for line_number, raw in enumerate(f, start=1):
                line = _decoded(raw, path, line_number, offset)
                offset += len(raw)
                if line.strip():  # blank lines (a trailing newline) are not records
                    yield file_index, line_number, line


def _decoded(raw: bytes, path: str, line_number: int, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        position = offset + error.start
        raise JSONLEncodingError(
            f"{path}:{line_number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at byte offset {position} "
            f"of the file): JSONL must be UTF-8, one JSON object per line. A binary file (parquet, arrow, gzip) must "
            f"be converted to JSONL first; text in another encoding re-encoded as UTF-8.") from None
