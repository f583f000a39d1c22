"""GPT samples of ``seq_length + 1`` consecutive tokens over shuffled documents (Megatron-LM semantics).

Three index arrays, built once with numpy and cached:
  * document index: the split's document ids repeated for enough epochs, shuffled;
  * sample index: row s = (position in the document index, token offset in that document)
    where sample s starts; sample s ends where sample s + 1 starts (one shared token), so
    samples run across document boundaries and no token within an epoch is dropped;
  * shuffle index: a permutation of the samples.
"""
from __future__ import annotations

import os

import numpy as np

from megatron_lite.data import index_cache
from megatron_lite.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

# Megatron shuffles the last epoch on its own when less than this fraction of it is used,
# so the samples that are used are not dominated by the previous epochs' documents.
_SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest e with (e * tokens_per_epoch - 1) // seq_length >= num_samples."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_last_epoch: bool) -> np.ndarray:
    """The documents repeated ``num_epochs`` times and shuffled (the last epoch apart if asked)."""
    if not separate_last_epoch or num_epochs == 1:
        document_index = np.tile(documents, num_epochs).astype(np.int32)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate([first, last])


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """Rows (document-index position, offset) of each sample start, plus the end of the last sample.

    Sample s starts at token s * seq_length of the concatenated documents; a sample that ends
    exactly on a document's last token points at that token, not at the next document. Empty
    documents hold no token, so no boundary falls in one, except that sample 0 starts at row
    (0, 0) even when the first documents are empty, as in Megatron-LM's ``build_sample_idx``.
    """
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")  # first document ending after the token
    position[0] = 0
    offset = starts - (ends[position] - lengths[position])
    return np.stack([position, offset], axis=1)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples), then a separate permutation of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, *, num_samples: int, seq_length: int,
                      seed: int) -> dict:
    """The document, sample and shuffle indices for at least ``num_samples`` samples (whole epochs)."""
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(f"these {len(documents)} documents hold {tokens_per_epoch} tokens; a sample needs at least 2.")
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last_epoch = False
    if num_epochs > 1:
        samples_before_last_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = (num_samples - samples_before_last_epoch
                               < int(_SEPARATE_LAST_EPOCH_THRESHOLD * samples_per_epoch))
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_last_epoch)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total_samples)
    shuffled_first = samples_before_last_epoch if separate_last_epoch else total_samples
    shuffle_index = build_shuffle_index(shuffled_first, total_samples, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset:
    """Samples from documents [start, stop) of one indexed dataset; ``ds[i]["tokens"]`` has seq_length + 1 ids.

    Length is the number of samples in the whole epochs built, at least ``num_samples``.
    """

    def __init__(self, indexed_dataset: IndexedDataset, document_range: tuple[int, int], *, num_samples: int,
                 seq_length: int, seed: int, split_name: str, cache_dir: str, is_builder_rank: bool = True,
                 cache_wait_timeout_s: float = index_cache.DEFAULT_WAIT_TIMEOUT_S):
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.document_range = document_range
        start, stop = document_range
        prefix = indexed_dataset.path_prefix
        description = {
            "class": "GPTDataset", "path_prefix": os.path.abspath(prefix), "split": split_name,
            # File sizes catch a re-preprocessed corpus under the same prefix.
            "bin_bytes": os.path.getsize(data_file_path(prefix)), "idx_bytes": os.path.getsize(index_file_path(prefix)),
            "documents": [int(start), int(stop)], "num_samples": int(num_samples), "seq_length": int(seq_length),
            "seed": int(seed)}
        try:
            arrays = index_cache.load_or_build(
                index_cache.cache_prefix(cache_dir, f"GPTDataset-{split_name}", description), description,
                ("document_index", "sample_index", "shuffle_index"),
                lambda: build_gpt_indices(indexed_dataset.sequence_lengths, np.arange(start, stop),
                                          num_samples=num_samples, seq_length=seq_length, seed=seed),
                is_builder_rank=is_builder_rank, timeout_s=cache_wait_timeout_s)
        except ValueError as error:
            raise ValueError(f"{prefix}, {split_name} split (documents {start} to {stop}): {error} "
                             "Change --split or add data.") from None
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def describe(self) -> str:
        start, stop = self.document_range
        epochs = len(self.document_index) // max(1, stop - start)
        return f"{self.indexed_dataset.path_prefix} ({stop - start} sequences, {len(self)} samples, {epochs} epochs)"

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a GPTDataset of {len(self)} samples")
        return {"tokens": self.unshuffled_sample(int(self.shuffle_index[index]))}

    def unshuffled_sample(self, sample: int) -> np.ndarray:
        """Tokens of sample ``sample`` in document-index order (before the shuffle index)."""
        (first, first_offset), (last, last_offset) = self.sample_index[sample], self.sample_index[sample + 1]
        documents = self.document_index
        if first == last:
            parts = [self.indexed_dataset.get(documents[first], first_offset, last_offset - first_offset + 1)]
        else:
            parts = [self.indexed_dataset.get(documents[first], first_offset)]
            parts += [self.indexed_dataset.get(documents[i]) for i in range(first + 1, last)]
            parts.append(self.indexed_dataset.get(documents[last], 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)
