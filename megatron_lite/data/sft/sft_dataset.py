"""Fine-tuning samples of ``seq_length`` positions: one example padded, or several packed.

An example of n ids (prompt, response, EOD; the first ``seq_length + 1`` kept) fills n - 1 positions:
inputs ``ids[:-1]``, labels ``ids[1:]``, the loss mask of the labels, position ids 0 .. n - 2.

  * Padding (the default): one example per sample; the remaining positions are padding without loss.
  * Packing (``--sft-pack-sequences``): examples, in order, fill a sample while they fit (next-fit).
    Position ids restart at 0 for each example and ``document_ids`` number each position's example, which
    attention keeps apart (``model/document_rows.py``: each in a row of its own, no [s, s] mask), so an
    example attends only to itself and its logits and loss are what they would be alone (docs/reference.md section 10).

Every epoch visits the examples in a new order (``numpy.random.RandomState(seed + epoch)``); as many
epochs as ``num_samples`` needs are laid out, so every data-parallel layout reads the same samples.
"""
from __future__ import annotations

import functools

import numpy as np

from megatron_lite.data.sft.examples import SFTDataError, SFTExamples


class SFTDataset:
    """``dataset[i]``: tokens, labels, position_ids (int64), loss_mask (float32), each [seq_length], and when
    packing document_ids (int64 [seq_length]: each position's example, 0, 1, ..., the padding after them one more)."""

    def __init__(self, examples: SFTExamples, *, seq_length: int, num_samples: int, seed: int, pad_token: int,
                 pack_sequences: bool = False):
        self.examples = examples
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.pad_token = pad_token
        self.pack_sequences = pack_sequences
        positions = example_positions(examples.lengths, seq_length)
        truncated = np.flatnonzero(examples.lengths > seq_length + 1)
        self.num_truncated = len(truncated)
        # A prompt longer than the sequence leaves nothing to learn from; say so rather than train on nothing.
        self.num_without_loss = sum(not examples.get(int(i))[1][1:seq_length + 1].any() for i in truncated)
        if self.num_without_loss == len(examples):  # a run on them trains on nothing (loss 0, grad norm 0)
            raise SFTDataError(f"every one of the {len(examples)} fine-tuning examples is longer than --seq-length + 1 "
                               f"= {seq_length + 1} tokens with a prompt that fills the sequence: none has a response "
                               f"token to learn from. Raise --seq-length or shorten the prompts.")
        self.layout = EpochLayout(positions, num_samples=num_samples, seed=seed,
                                  bins=functools.partial(next_fit_bins, capacity=seq_length) if pack_sequences
                                  else None)
        # The real (not padding) positions of the first n samples: what throughput counts as trained on.
        self._positions_before = np.concatenate([[0], np.cumsum(self.layout.sample_sizes(positions)[:num_samples])])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for an SFTDataset of {self.num_samples} samples")
        members = self.layout.members(index)
        return build_sample([self.examples.get(int(i)) for i in members], seq_length=self.seq_length,
                            pad_token=self.pad_token, pack_sequences=self.pack_sequences)

    def tokens_in(self, num_samples: int) -> int:
        """The tokens the first ``num_samples`` samples feed through the model: their examples' positions, not
        the padding after them (a packed sample's leftover positions are padding too)."""
        return int(self._positions_before[min(num_samples, self.num_samples)])

    def describe(self) -> str:
        """For the start-up summary: examples, samples, epochs and truncations (never silent)."""
        layout = "packed" if self.pack_sequences else "one example each, padded"
        line = (f"{len(self.examples)} fine-tuning examples ({self.num_samples} samples of {self.seq_length} "
                f"positions, {layout}, {len(self.layout.orders)} epochs; {self.num_truncated} examples longer than "
                f"--seq-length + 1 = {self.seq_length + 1} tokens truncated")
        if self.num_without_loss:
            line += f", {self.num_without_loss} of them losing every response token (their prompt fills the sequence)"
        return line + ")" + "".join(f"; {description}" for description in self.examples.descriptions)


class EpochLayout:
    """Items (examples, or pairs) in a new order every epoch (``numpy.random.RandomState(seed + epoch)``), cut
    into samples in that order by ``bins`` (boundaries of the ordered ``sizes``; None: one item per sample),
    over as many epochs as ``num_samples`` needs."""

    def __init__(self, sizes: np.ndarray, *, num_samples: int, seed: int, bins=None):
        self.orders, self.bin_starts, offsets = [], [], [0]
        while offsets[-1] < num_samples:
            order = np.random.RandomState(seed + len(self.orders)).permutation(len(sizes))
            starts = bins(sizes[order]) if bins is not None else np.arange(len(order) + 1)
            self.orders.append(order)
            self.bin_starts.append(starts)
            offsets.append(offsets[-1] + len(starts) - 1)
        self.epoch_offsets = np.asarray(offsets)

    def members(self, sample: int) -> np.ndarray:
        """The items of ``sample``, in order."""
        epoch = int(np.searchsorted(self.epoch_offsets, sample, side="right")) - 1
        in_epoch = sample - int(self.epoch_offsets[epoch])
        starts = self.bin_starts[epoch]
        return self.orders[epoch][starts[in_epoch]:starts[in_epoch + 1]]

    def sample_sizes(self, sizes: np.ndarray) -> np.ndarray:
        """The total ``sizes`` of each sample's items, sample by sample over every epoch laid out."""
        per_epoch = []
        for order, starts in zip(self.orders, self.bin_starts):
            filled = np.concatenate([[0], np.cumsum(sizes[order])])
            per_epoch.append(filled[starts[1:]] - filled[starts[:-1]])
        return np.concatenate(per_epoch)


def example_positions(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """The positions each example fills: n ids give n - 1 inputs, the first ``seq_length + 1`` ids kept."""
    return np.minimum(lengths, seq_length + 1) - 1


def next_fit_bins(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Bin boundaries ``[0, s1, ..., len(sizes)]`` when items, in order, go into the current bin while it has
    room and open a new bin otherwise (every size is at most ``capacity``)."""
    starts, used = [0], 0
    for index, size in enumerate(sizes.tolist()):
        if used + size > capacity:
            starts.append(index)
            used = 0
        used += size
    starts.append(len(sizes))
    return np.asarray(starts, dtype=np.int64)


def build_sample(examples: list[tuple[np.ndarray, np.ndarray]], *, seq_length: int, pad_token: int,
                 pack_sequences: bool) -> dict:
    """One sample from (ids, loss mask) examples placed one after another (see the module docstring)."""
    tokens = np.full(seq_length, pad_token, dtype=np.int64)
    labels = np.full(seq_length, pad_token, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    document = np.zeros(seq_length, dtype=np.int64)
    offset = 0
    for number, (ids, mask) in enumerate(examples):
        ids, mask = ids[:seq_length + 1], mask[:seq_length + 1]
        end = offset + len(ids) - 1
        tokens[offset:end], labels[offset:end], loss_mask[offset:end] = ids[:-1], ids[1:], mask[1:]
        position_ids[offset:end] = np.arange(end - offset)
        document[offset:end] = number
        offset = end
    # Padding is a document of its own: it attends to nothing real and carries no loss.
    position_ids[offset:] = np.arange(seq_length - offset)
    document[offset:] = len(examples)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if pack_sequences:
        sample["document_ids"] = document
    return sample
