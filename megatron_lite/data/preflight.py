"""Checks on the data flags made at start-up, before the model is built.

Without them a mistyped --data-path, or fine-tuning records with a misnamed field, fail only when the
datasets are built, after the model and optimizer: on a large model, minutes of start-up lost to a typo.
"""
from __future__ import annotations

import os

from megatron_lite.config import ConfigError, DataConfig
from megatron_lite.data.dataset_builder import parse_data_path
from megatron_lite.data.indexed_dataset import data_file_path, index_file_path
from megatron_lite.data.sft.examples import count_sft_examples, is_preprocessed_sft
from megatron_lite.data.sft.formats import RecordFormat, is_sft_data_source
from megatron_lite.data.sft.preference import count_preference_pairs
from megatron_lite.data.sft.prompts import count_prompts


def check_data_paths(data: DataConfig) -> None:
    """Raise one ConfigError naming the data flag(s), the paths that do not exist, and the files expected."""
    _refuse_directories(data)
    if data.sft:
        flags = (("--train-data-path", data.train_data_path), ("--valid-data-path", data.valid_data_path),
                 ("--test-data-path", data.test_data_path))
        missing = [f"{flag} {path}" for flag, paths in flags for path in paths
                   if not (is_sft_data_source(path) or is_preprocessed_sft(path))]
        if missing:
            raise ConfigError(f"{', '.join(missing)} {_do_not_exist(missing)}; fine-tuning data is JSONL, JSON, "
                              "Parquet or Arrow files, datasets.save_to_disk directories, or the --output-prefix "
                              "PREFIX of tools/preprocess_data.py --sft (which writes PREFIX_text_document.bin/.idx "
                              "and PREFIX_loss_mask_document.bin/.idx).")
        record_format = RecordFormat.from_flags(data.sft_format, data.sft_data_keys)
        for _, paths in flags:  # a misnamed field fails now, not after the model is built
            if data.dpo:
                count_preference_pairs(paths)
            elif data.grpo:
                count_prompts(paths)
            else:
                count_sft_examples(paths, record_format)
    elif not data.mock_data:
        _, prefixes = parse_data_path(data.data_path)
        missing = [path for prefix in prefixes for path in (index_file_path(prefix), data_file_path(prefix))
                   if not os.path.isfile(path)]
        if missing:
            raise ConfigError(f"--data-path: {', '.join(missing)} {_do_not_exist(missing)}; it takes each "
                              "dataset's prefix without .bin/.idx (for example my-corpus_text_document), as "
                              "written by tools/preprocess_data.py.")


def _refuse_directories(data: DataConfig) -> None:
    """A directory is a path that exists: say it is one, rather than that it "does not exist". A
    datasets.save_to_disk directory is fine-tuning data, not such a mistake."""
    flags = (("--train-data-path", data.train_data_path), ("--valid-data-path", data.valid_data_path),
             ("--test-data-path", data.test_data_path),
             ("--data-path", parse_data_path(data.data_path)[1] if data.data_path else []))
    directories = [f"{flag} {path}" for flag, paths in flags for path in paths
                   if os.path.isdir(path) and not (flag != "--data-path" and is_sft_data_source(path))]
    if directories:
        raise ConfigError(f"{', '.join(directories)}: a directory, where a file is expected: give the JSONL file "
                          "(fine-tuning) or the dataset prefix written by tools/preprocess_data.py (PREFIX for "
                          "PREFIX.bin/.idx, or DIR/PREFIX), not the directory holding them.")


def _do_not_exist(paths: list[str]) -> str:
    return "does not exist" if len(paths) == 1 else "do not exist"
