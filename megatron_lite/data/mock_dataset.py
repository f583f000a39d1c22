"""Synthetic tokens for ``--mock-data``: sample i depends only on (seed, i).

So every parallel layout, and a resumed run, sees the same global batches. The tokens
follow simple rules a small model learns in a few hundred steps, so the loss visibly
falls in a demo: half the samples are arithmetic progressions (next = previous + step
modulo the vocabulary), half repeat a short random motif (next = the token one period back).
"""
from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` token ids in [0, vocab_size)."""

    def __init__(self, *, vocab_size: int, seq_length: int, seed: int, num_samples: int):
        if vocab_size < 2 or seq_length < 1 or num_samples < 0:
            raise ValueError(f"MockGPTDataset needs vocab_size >= 2, seq_length >= 1 and num_samples >= 0; got "
                             f"{vocab_size}, {seq_length}, {num_samples}.")
        self.vocab_size, self.seq_length, self.seed, self.num_samples = vocab_size, seq_length, seed, num_samples

    def describe(self) -> str:
        return f"mock data ({self.num_samples} samples of synthetic tokens: the loss will not fall)"

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for a MockGPTDataset of {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])
        length = self.seq_length + 1
        if rng.random() < 0.5:
            start, step = rng.integers(self.vocab_size), rng.integers(1, 8)
            tokens = (start + step * np.arange(length)) % self.vocab_size
        else:
            motif = rng.integers(self.vocab_size, size=rng.integers(2, 9))
            tokens = np.resize(motif, length)  # repeats the motif to fill the sample
        return {"tokens": tokens.astype(np.int64)}
