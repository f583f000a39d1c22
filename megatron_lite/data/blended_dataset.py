"""Deterministic weighted mixture of datasets (Megatron-LM's BlendedDataset).

Output sample s comes from the dataset that is furthest behind its share: the k with the
largest ``w_k * max(s, 1) - used_k``. Unlike sampling at random, the realised mixture
tracks the weights within one sample at every prefix, and it is the same on every rank.
"""
from __future__ import annotations

import numpy as np

from megatron_lite.data import index_cache


def normalize(weights: list[float]) -> list[float]:
    """Weights divided by their sum, in float64 with numpy's summation, so the shares, split
    boundaries and blend match Megatron-LM's ``normalize`` bit for bit."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / array.sum()).tolist()


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index): which dataset, and which of its samples, each output sample is."""
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    used = [0] * len(weights)
    for sample in range(size):
        target = max(sample, 1)
        errors = [w * target - u for w, u in zip(weights, used)]
        chosen = errors.index(max(errors))  # ties go to the lowest dataset index
        dataset_index[sample] = chosen
        dataset_sample_index[sample] = used[chosen]
        used[chosen] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (normalised here)."""

    def __init__(self, datasets: list, weights: list[float], size: int, *, cache_dir: str,
                 is_builder_rank: bool = True, cache_wait_timeout_s: float = index_cache.DEFAULT_WAIT_TIMEOUT_S):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(weights)} for {len(datasets)}.")
        self.weights = normalize(weights)
        self.datasets = datasets
        self.size = size
        # The blending indices depend on nothing but the weights and the size.
        description = {"class": "BlendedDataset", "weights": self.weights, "size": int(size)}
        arrays = index_cache.load_or_build(
            index_cache.cache_prefix(cache_dir, "BlendedDataset", description), description,
            ("dataset_index", "dataset_sample_index"),
            lambda: dict(zip(("dataset_index", "dataset_sample_index"), build_blending_indices(self.weights, size))),
            is_builder_rank=is_builder_rank, timeout_s=cache_wait_timeout_s)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for k, dataset in enumerate(datasets):
            needed = int(np.count_nonzero(self.dataset_index == k))
            if needed > len(dataset):
                raise ValueError(f"blended dataset {k} has {len(dataset)} samples but the blend needs {needed}; "
                                 "build it with more samples.")

    def __len__(self) -> int:
        return self.size

    def describe(self) -> str:
        return "blend of " + " + ".join(f"{w:.3g} x {d.describe()}" for w, d in zip(self.weights, self.datasets))

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for a BlendedDataset of {self.size} samples")
        return self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]
