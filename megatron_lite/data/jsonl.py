"""Reading JSONL input line by line, keeping each line's place so a bad one can be named ``file:line``."""
from __future__ import annotations


def read_jsonl_lines(input_paths: list[str]):
    """(file index, line number from 1, line) for every non-blank line of the files, in order."""
    for file_index, path in enumerate(input_paths):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip():  # blank lines (a trailing newline) are not records
                    yield file_index, line_number, line
