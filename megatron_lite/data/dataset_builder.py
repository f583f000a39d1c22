"""``--data-path`` and ``--split`` to train/valid/test datasets, blended when several corpora are given."""
from __future__ import annotations

import math
import os
from typing import Optional

from megatron_lite.config import ConfigError
from megatron_lite.data import index_cache
from megatron_lite.data.blended_dataset import BlendedDataset
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
# Each blended corpus builds slightly more samples than its share, so the greedy blend
# (which can run one sample ahead of a share) never runs out (Megatron's margin).
_BLEND_SAMPLE_MARGIN = 1.005


def parse_data_path(data_path: list[str]) -> tuple[list[float], list[str]]:
    """``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` -> (normalised weights, prefixes)."""
    if not data_path:
        raise ConfigError("--data-path is empty: give PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    if len(data_path) == 1:
        return [1.0], [str(data_path[0])]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path with several corpora must alternate weight and prefix "
                         f"(W1 PREFIX1 W2 PREFIX2 ...); got {len(data_path)} items: {data_path}.")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ConfigError(f"--data-path weights must be numbers, got {data_path[0::2]}; the form is "
                         "W1 PREFIX1 W2 PREFIX2 ...") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path weights must be non-negative with a positive sum, got {weights}.")
    return [w / sum(weights) for w in weights], [str(p) for p in data_path[1::2]]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``969/30/1``, or fewer parts) -> three normalised weights."""
    try:
        weights = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, got {split!r}.") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split takes up to three non-negative weights with a positive sum, got {split!r}.")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_document_boundaries(num_documents: int, split_weights: list[float]) -> list[int]:
    """Document boundaries [0, b1, b2, num_documents] of train/valid/test, rounded as Megatron-LM does."""
    boundaries = [0]
    for weight in split_weights:
        boundaries.append(boundaries[-1] + int(round(weight * float(num_documents))))
    excess = boundaries[-1] - num_documents
    return [boundaries[0]] + [b - excess for b in boundaries[1:]]


def build_train_valid_test_datasets(*, data_path: list[str], split: str, seq_length: int, seed: int,
                                    train_valid_test_num_samples: tuple[int, int, int],
                                    data_cache_path: Optional[str] = None, is_builder_rank: bool = True,
                                    cache_wait_timeout_s: float = index_cache.DEFAULT_WAIT_TIMEOUT_S):
    """(train, valid, test) datasets; None for a split with no documents or no requested samples.

    The builder rank builds (or loads) the cached indices; the other ranks wait for its files,
    so call it on the builder rank first or on all ranks at once.
    """
    weights, prefixes = parse_data_path(data_path)
    split_weights = parse_split(split)
    if seq_length < 1:
        raise ConfigError(f"--seq-length must be positive, got {seq_length}.")
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples needs three counts, got {train_valid_test_num_samples}.")
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    boundaries = [split_document_boundaries(len(d), split_weights) for d in indexed]

    def cache_dir(prefix: str) -> str:
        return data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")

    def gpt_dataset(k: int, split_index: int, num_samples: int):
        start, stop = boundaries[k][split_index], boundaries[k][split_index + 1]
        if stop <= start or num_samples <= 0:
            return None
        return GPTDataset(indexed[k], (start, stop), num_samples=num_samples, seq_length=seq_length, seed=seed,
                          split_name=SPLIT_NAMES[split_index], cache_dir=cache_dir(prefixes[k]),
                          is_builder_rank=is_builder_rank,
                          cache_wait_timeout_s=cache_wait_timeout_s)

    datasets = []
    for split_index, num_samples in enumerate(train_valid_test_num_samples):
        if len(prefixes) == 1:
            datasets.append(gpt_dataset(0, split_index, num_samples))
            continue
        parts = [(gpt_dataset(k, split_index, int(math.ceil(num_samples * w * _BLEND_SAMPLE_MARGIN))), w)
                 for k, w in enumerate(weights) if w > 0]
        # A corpus too small to have documents in this split drops out of this split's blend.
        parts = [(dataset, w) for dataset, w in parts if dataset is not None]
        if not parts or num_samples <= 0:
            datasets.append(None)
            continue
        datasets.append(BlendedDataset([d for d, _ in parts], [w for _, w in parts], num_samples,
                                       cache_dir=cache_dir(prefixes[0]), is_builder_rank=is_builder_rank,
                                       cache_wait_timeout_s=cache_wait_timeout_s))
    return tuple(datasets)
