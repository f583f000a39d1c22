"""``--data-path`` and ``--split`` to train/valid/test datasets, blended when several corpora are given."""
from __future__ import annotations

import math
import os
from typing import Optional

from megatron_lite.config import ConfigError
from megatron_lite.data import index_cache
from megatron_lite.data.blended_dataset import BlendedDataset, normalize
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
# Each blended corpus builds slightly more samples than its share, so the greedy blend
# (which can run one sample ahead of a share) never runs out (Megatron's mid_level_dataset_surplus).
_MID_LEVEL_DATASET_SURPLUS = 0.005


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
    return normalize(weights), [str(p) for p in data_path[1::2]]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``969/30/1``, or fewer parts) -> three normalised weights."""
    try:
        weights = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, got {split!r}.") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split takes up to three non-negative weights with a positive sum, got {split!r}.")
    weights += [0.0] * (3 - len(weights))
    return normalize(weights)


def split_document_boundaries(num_documents: int, split_weights: list[float]) -> list[int]:
    """Document boundaries [0, b1, b2, num_documents] of train/valid/test.

    As Megatron-LM's builder, each boundary is the cumulative fraction (0.969, 0.999, 1.0 for
    969,30,1) times the count, rounded (half to even); rounding each part instead would give
    other boundaries (over 49 documents train [0, 48) instead of Megatron's [0, 47)). The count is
    of sequences, which is of documents except that an empty document has no sequence.
    """
    boundaries, cumulative = [0], 0.0
    for weight in split_weights:
        cumulative += weight
        boundaries.append(int(round(cumulative * float(num_documents))))
    return boundaries


def blended_sample_counts(num_samples: int, weights: list[float]) -> tuple[list[int], list[int]]:
    """(share, built) per blended dataset for a blend of ``num_samples``, as Megatron-LM sizes them.

    Dataset k's share is ceil(N * w_k) and the blend's length is the sum of the shares, which
    can pass N by up to one sample per dataset (1001 for N = 1000, w = [1/3, 2/3]); dataset k
    builds ceil(share * 1.005) samples, the margin the greedy blend may overdraw.
    """
    shares = [int(math.ceil(num_samples * w)) for w in weights]
    return shares, [int(math.ceil(share * (1 + _MID_LEVEL_DATASET_SURPLUS))) for share in shares]


def build_train_valid_test_datasets(*, data_path: list[str], split: str, seq_length: int, seed: int,
                                    train_valid_test_num_samples: tuple[int, int, int],
                                    data_cache_path: Optional[str] = None, is_builder_rank: bool = True,
                                    cache_wait_timeout_s: float = index_cache.DEFAULT_WAIT_TIMEOUT_S,
                                    mmap_bin_files: bool = True):
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
    indexed = [IndexedDataset(prefix, mmap=mmap_bin_files) for prefix in prefixes]
    boundaries = [split_document_boundaries(len(d), split_weights) for d in indexed]

    def cache_dir(prefix: str) -> str:
        return data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")

    def gpt_dataset(k: int, split_index: int, num_samples: int):
        start, stop = boundaries[k][split_index], boundaries[k][split_index + 1]
        if stop <= start or num_samples <= 0:
            return None
        if int(indexed[k].sequence_lengths[start:stop].sum()) < 2:  # not one sample; known alike on every rank
            return _too_few_tokens(prefixes[k], split_index, start, stop, split, notice=is_builder_rank)
        return GPTDataset(indexed[k], (start, stop), num_samples=num_samples, seq_length=seq_length, seed=seed,
                          split_name=SPLIT_NAMES[split_index], cache_dir=cache_dir(prefixes[k]),
                          is_builder_rank=is_builder_rank,
                          cache_wait_timeout_s=cache_wait_timeout_s)

    datasets = []
    for split_index, num_samples in enumerate(train_valid_test_num_samples):
        if len(data_path) == 1:  # one prefix without a weight; "1.0 PREFIX" is a blend of one, as in Megatron-LM
            datasets.append(gpt_dataset(0, split_index, num_samples))
            continue
        # A corpus with weight 0, or too small to have documents in this split, drops out of this
        # split's blend and the others share its weight (Megatron-LM refuses a zero weight and cannot
        # build a split without documents, so it has no rule to follow here).
        parts = [k for k, w in enumerate(weights)
                 if w > 0 and boundaries[k][split_index + 1] > boundaries[k][split_index]]
        if not parts or num_samples <= 0:
            datasets.append(None)
            continue
        part_weights = [weights[k] for k in parts]
        if len(parts) < len(weights):
            part_weights = normalize(part_weights)
        shares, built = blended_sample_counts(num_samples, part_weights)
        datasets.append(BlendedDataset([gpt_dataset(k, split_index, n) for k, n in zip(parts, built)], part_weights,
                                       sum(shares), cache_dir=cache_dir(prefixes[0]),
                                       is_builder_rank=is_builder_rank, cache_wait_timeout_s=cache_wait_timeout_s))
    return tuple(datasets)


def _too_few_tokens(prefix: str, split_index: int, start: int, stop: int, split: str, *, notice: bool) -> None:
    """A train split without a sample is an error; a validation or test split is skipped, with a notice."""
    message = (f"{prefix}: the {SPLIT_NAMES[split_index]} split (--split {split}, sequences {start} to {stop}) "
               "holds fewer than 2 tokens, not one sample")
    if split_index == 0:
        raise ConfigError(f"{message}; give it more documents with --split or add data.")
    if notice:
        print(f" notice: {message}; it is skipped.", flush=True)
    return None
