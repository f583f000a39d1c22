"""JSONL -> indexed datasets: the engine behind ``tools/preprocess_data.py``.

Worker processes tokenize lines; the main process writes documents in input order. A bad
line (malformed JSON, a missing or non-string key, ids the tokenizer rejects) is reported
as ``file:line`` and skipped, or aborts the run with ``strict``. Outputs go through
``IndexedDatasetBuilder``, so they appear only when complete.

An empty document (``{"text": ""}``, or text that tokenizes to nothing) is kept as Megatron-LM's
``tools/preprocess_data.py`` keeps it: no tokens and no EOD even with ``append_eod``, no sequence,
but its own entry in the document indices. So the same JSONL gives the same ``.bin``/``.idx``
bytes, and the same samples, in both projects.

Fine-tuning data (``sft_prompt_format``) is a prompt/response, chat, Alpaca or ShareGPT record per line
of JSONL, element of a JSON array or row of a Parquet/Arrow table (``data/sft/formats.py``): it becomes
two datasets of equal lengths, the token ids and their loss mask (``data/sft``). Preference pairs (``preference``,
TRL's prompt/chosen/rejected records) are written alike, each pair one document of two sequences, chosen then
rejected (``data/sft/preference.py``).

Progress lines show the share of the input read and an ETA when its size is known (text files: their bytes).
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, TextIO

import numpy as np

from megatron_lite.config import UserError
from megatron_lite.data.jsonl import read_jsonl_lines
from megatron_lite.data.sft.examples import LOSS_MASK_KEY, TOKENS_KEY, encode_sft_line, write_prompt_format
from megatron_lite.data.sft.formats import RecordFormat, container_of, is_sft_data_source, read_sft_records
from megatron_lite.data.sft.preference import encode_preference_line
from megatron_lite.data.indexed_dataset import (IndexedDatasetBuilder, best_fitting_dtype, data_file_path,
                                                index_file_path, output_prefix_for)
from megatron_lite.tokenizer import build_tokenizer


class PreprocessError(UserError, RuntimeError):
    """The input cannot be preprocessed (with ``strict``, any bad line)."""


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bad_lines: int = 0
    empty_documents: int = 0
    first_problem: str = ""  # "file:line: problem" of the first bad line
    input_bytes: int = 0
    seconds: float = 0.0


def encode_line(line: str, tokenizer, json_keys: tuple[str, ...], append_eod: bool):
    """One JSON line -> ({key: ids}, None), or (None, problem) for a bad line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return None, f"malformed JSON ({error.msg} at column {error.colno})"
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    encoded = {}
    for key in json_keys:
        if key not in record:
            return None, f"missing key {key!r} (--json-keys); the line has keys {sorted(record)}"
        if not isinstance(record[key], str):
            return None, f"key {key!r} is {type(record[key]).__name__}, not a string"
        try:
            ids = tokenizer.tokenize(record[key])
        except ValueError as error:
            return None, f"tokenizer rejected {key!r}: {error}"
        if append_eod and ids:  # an empty document gets no EOD either (Megatron-LM's rule)
            ids.append(tokenizer.eod)
        encoded[key] = np.asarray(ids, dtype=np.int32)  # half the bytes of int64 between processes
    return encoded, None


# Lines per task a worker receives: enough that the pool's cost per task (pickling, two pipes, a result thread) is
# small against tokenizing them, few enough that the main process can encode a share in the gaps.
LINES_PER_TASK = 64
# Tasks queued per worker, so that a worker never waits for the main process between two of them.
TASKS_PER_WORKER = 2

_worker = {}  # each worker process's tokenizer and options, set once by _init_worker


def _init_worker(tokenizer_kwargs: dict, encode) -> None:
    _worker.update(tokenizer=build_tokenizer(**tokenizer_kwargs), encode=encode)


def _encode_records(records: list, encode, tokenizer) -> list:
    """(file index, line number, bytes, encoded, problem) of each (file index, line number, line)."""
    results = []
    for file_index, line_number, line in records:
        encoded, problem = encode(line, tokenizer)
        results.append((file_index, line_number, len(line.encode("utf-8")), encoded, problem))
    return results


def _encode_in_worker(records: list) -> list:
    return _encode_records(records, _worker["encode"], _worker["tokenizer"])


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _encoded_in_order(records, pool, workers: int, encode_here=None):
    """_encode_records's results of ``records`` in input order.

    Tasks of LINES_PER_TASK records go to the pool. With ``encode_here`` (a core is left over beside the
    workers), the main process encodes the next task itself whenever the oldest one is not back yet, instead
    of waiting for it: with one worker on two cores both then tokenize."""
    records = iter(records)
    tasks = iter(lambda: list(itertools.islice(records, LINES_PER_TASK)), [])
    pending = collections.deque()  # in input order: (AsyncResult, None) of a worker's task, (None, results) of ours
    queued, more = 0, True
    while True:
        while more and queued < TASKS_PER_WORKER * workers:
            task = next(tasks, None)
            more = task is not None
            if more:
                pending.append((pool.apply_async(_encode_in_worker, (task,)), None))
                queued += 1
        if not pending:
            return
        in_worker, results = pending[0]
        if encode_here is not None and more and in_worker is not None and not in_worker.ready():
            task = next(tasks, None)
            more = task is not None
            if more:
                pending.append((None, encode_here(task)))
            continue
        pending.popleft()
        if in_worker is not None:
            queued -= 1
            results = in_worker.get()
        yield from results


def preprocess_jsonl(input_paths: list[str], *, output_prefix: str, tokenizer_kwargs: dict,
                     json_keys: tuple[str, ...] = ("text",), append_eod: bool = False, workers: int = 1,
                     log_interval: int = 1000, strict: bool = False, log: Optional[TextIO] = None,
                     sft_prompt_format: Optional[str] = None,
                     sft_record_format: RecordFormat = RecordFormat(), preference: bool = False) -> PreprocessStats:
    """Tokenizes every line of ``input_paths`` into one ``.bin``/``.idx`` pair per JSON key.

    Args:
        tokenizer_kwargs: arguments of ``build_tokenizer`` (tokenizer_type, vocab_file, ...).
        workers: tokenizer processes; the main process reads and writes, and tokenizes too where fewer workers
            than usable cores leave one free.
        sft_prompt_format: fine-tuning records instead of ``json_keys``: writes the pairs
            ``{output_prefix}_text_document`` (ids, EOD included) and ``{output_prefix}_loss_mask_document``,
            and records the format in ``{output_prefix}_prompt_format.json``.
        sft_record_format: how fine-tuning records are read (--sft-format, --sft-data-keys).
        preference: with ``sft_prompt_format``, the records are preference pairs (--dpo): each is written as one
            document of two sequences, chosen then rejected.
    """
    log = log or sys.stderr
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}.")
    for path in input_paths:
        if not (os.path.isfile(path) or (sft_prompt_format is not None and is_sft_data_source(path))):
            raise PreprocessError(f"--input {path} is not a file; give a JSONL file with one JSON object per line"
                                  + (" (--sft: or a JSON, Parquet or Arrow file, or a datasets.save_to_disk "
                                     "directory)." if sft_prompt_format is not None else "."))
    tokenizer = build_tokenizer(**tokenizer_kwargs)  # fails here, clearly, before any worker starts
    dtypes, encode = _outputs_and_encoder(tokenizer.vocab_size, json_keys, append_eod, sft_prompt_format,
                                          sft_record_format, preference)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = {}
    stats = PreprocessStats()
    start = time.monotonic()
    # Forked workers start at once (no re-import of torch); they only run the tokenizer.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    try:
        for key, dtype in dtypes.items():
            builders[key] = IndexedDatasetBuilder(data_file_path(output_prefix_for(output_prefix, key)), dtype)
        with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_kwargs, encode)) as pool:
            records = read_jsonl_lines(input_paths) if sft_prompt_format is None else read_sft_records(input_paths)
            encode_here = (functools.partial(_encode_records, encode=encode, tokenizer=tokenizer)
                           if workers < _usable_cores() else None)
            results = _encoded_in_order(records, pool, workers, encode_here)
            _write_documents(results, builders, stats, input_paths=input_paths, strict=strict, log=log,
                             log_interval=log_interval, start=start, total_bytes=_text_bytes(input_paths))
        if stats.documents == 0:  # an empty dataset would only fail later, inside training
            raise PreprocessError(f"no documents written: {_why_no_documents(stats, input_paths)}")
        for key, builder in builders.items():
            builder.finalize(index_file_path(output_prefix_for(output_prefix, key)))
        if sft_prompt_format is not None:  # so a run on this data cannot name another template unnoticed
            write_prompt_format(output_prefix, sft_prompt_format)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    stats.seconds = time.monotonic() - start
    print(_summary(stats), file=log)
    return stats


def _outputs_and_encoder(vocab_size: int, json_keys, append_eod: bool, sft_prompt_format: Optional[str],
                         sft_record_format: RecordFormat, preference: bool):
    """The dataset each output key gets, with its token dtype, and the function that encodes one input line."""
    if sft_prompt_format is None:
        dtypes = {key: best_fitting_dtype(vocab_size) for key in json_keys}
        return dtypes, functools.partial(encode_line, json_keys=tuple(json_keys), append_eod=append_eod)
    dtypes = {TOKENS_KEY: best_fitting_dtype(vocab_size), LOSS_MASK_KEY: np.uint8}
    if preference:
        return dtypes, functools.partial(encode_preference_line, prompt_format=sft_prompt_format)
    return dtypes, functools.partial(encode_sft_line, prompt_format=sft_prompt_format,
                                     record_format=sft_record_format)


def _summary(stats: PreprocessStats) -> str:
    summary = f"done: {stats.documents} documents, {stats.tokens} tokens in {stats.seconds:.1f} s"
    if stats.bad_lines:
        summary += f"; skipped {stats.bad_lines} bad lines (listed above)"
    if stats.empty_documents:
        summary += f"; {stats.empty_documents} empty documents kept without tokens"
    return summary


# Bad lines before any good one after which the input is taken as misread (a wrong --json-keys): a run
# would otherwise list every line of a large corpus before its "no documents written".
ABORT_AFTER_BAD_LINES = 20


def _text_bytes(input_paths: list[str]) -> Optional[int]:
    """The input's size in the bytes the progress counts, when every file is text (a table's rows are not)."""
    if not all(os.path.isfile(path) and container_of(path) in ("JSONL", "JSON array") for path in input_paths):
        return None
    return sum(os.path.getsize(path) for path in input_paths)


def progress_line(*, documents: int, done_bytes: int, total_bytes: Optional[int], elapsed: float) -> str:
    """``processed N documents (docs/s, MB/s[, P% of T MB, ETA h:mm:ss])``."""
    line = (f"processed {documents} documents ({documents / elapsed:.1f} docs/s, "
            f"{done_bytes / elapsed / 1e6:.2f} MB/s")
    if total_bytes and done_bytes:
        remaining_s = int(elapsed * max(total_bytes - done_bytes, 0) / done_bytes)
        line += (f", {100 * min(done_bytes / total_bytes, 1):.1f}% of {total_bytes / 1e6:.2f} MB, "
                 f"ETA {remaining_s // 3600}:{remaining_s // 60 % 60:02d}:{remaining_s % 60:02d}")
    return line + ")"


def _write_documents(results, builders: dict, stats: PreprocessStats, *, input_paths: list[str], strict: bool,
                     log: TextIO, log_interval: int, start: float, total_bytes: Optional[int]) -> None:
    """Adds the workers' documents to the builders in input order, reporting (or, strict, raising on) bad lines."""
    for file_index, line_number, size, encoded, problem in results:
        stats.input_bytes += size
        if problem is not None:
            where = f"{input_paths[file_index]}:{line_number}"
            if strict:
                raise PreprocessError(f"{where}: {problem} (--strict: aborting, no output written)")
            stats.bad_lines += 1
            stats.first_problem = stats.first_problem or f"{where}: {problem}"
            print(f"{where}: {problem}; skipped", file=log)
            if stats.documents == 0 and stats.bad_lines == ABORT_AFTER_BAD_LINES:
                raise PreprocessError(f"the first {ABORT_AFTER_BAD_LINES} lines were all skipped, the first as "
                                      f"{stats.first_problem}; stopping instead of listing every line. Fix "
                                      f"--json-keys or the input.")
            continue
        # A key's value is one sequence, or a list of them that make one document (a preference pair).
        sequences = {key: ids if isinstance(ids, list) else [ids] for key, ids in encoded.items()}
        if any(np.size(ids) == 0 for values in sequences.values() for ids in values):
            stats.empty_documents += 1
        for key, values in sequences.items():
            if len(values) == 1:
                builders[key].add_document(values[0])
            else:
                for ids in values:
                    builders[key].add_item(ids)
                builders[key].end_document()
        stats.documents += 1
        stats.tokens += sum(np.size(ids) for key, values in sequences.items() if key != LOSS_MASK_KEY for ids in values)
        if stats.documents % log_interval == 0:
            print(progress_line(documents=stats.documents, done_bytes=stats.input_bytes, total_bytes=total_bytes,
                                elapsed=time.monotonic() - start), file=log)


def _why_no_documents(stats: PreprocessStats, input_paths: list[str]) -> str:
    if stats.bad_lines:
        return (f"all {stats.bad_lines} lines were skipped, the first as {stats.first_problem}. "
                "Fix --json-keys or the input.")
    return f"{', '.join(input_paths)} holds no non-blank lines."
