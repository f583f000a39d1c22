"""Megatron's pretraining sampler and the micro-batch loader built on it.

The position in the data is one global sample counter (``consumed_samples``). Each step
takes the next ``micro_batch_size * data_parallel_size`` samples in order and rank r reads
the r-th slice, so every data-parallel size sees the same global batch and a resumed run
(with any data-parallel size) continues exactly where the last one stopped.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from megatron_lite.config import ConfigError


class MegatronPretrainingSampler:
    """Yields this rank's lists of sample indices, one list per micro-batch, dropping a partial last step."""

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if micro_batch_size < 1 or data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= data_parallel_rank ({data_parallel_rank}) < "
                             f"data_parallel_size ({data_parallel_size}); got micro_batch_size {micro_batch_size}.")
        if not 0 <= consumed_samples <= total_samples:
            raise ConfigError(f"consumed samples ({consumed_samples}) is beyond the dataset's {total_samples} "
                             "samples: the checkpoint was trained on more data than was built; raise "
                             "--train-samples/--train-iters or check --data-path.")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def __iter__(self):
        step = self.micro_batch_size * self.data_parallel_size
        begin = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + begin, start + begin + self.micro_batch_size))


def collate_gpt_batch(samples: list[dict], *, eod_token: Optional[int], eod_mask_loss: bool) -> dict:
    """Stacks samples of seq_length + 1 ids into tokens/labels/loss_mask/position_ids of shape [b, s]."""
    full = torch.from_numpy(np.stack([sample["tokens"] for sample in samples]).astype(np.int64))
    tokens, labels = full[:, :-1].contiguous(), full[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        # As in Megatron-LM: positions whose *input* is EOD predict the first token of an
        # unrelated next document, so they carry no loss.
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(tokens.shape[1], dtype=torch.long).unsqueeze(0).expand_as(tokens).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def build_pretraining_data_loader(dataset, *, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                                  data_parallel_size: int, eod_token: Optional[int] = None,
                                  eod_mask_loss: bool = False, num_workers: int = 0, collate_fn=None):
    """An iterator over this rank's micro-batches, starting after ``consumed_samples`` global samples.

    Returns None for a None dataset (an empty split). Stops at the end of the dataset. ``collate_fn``
    replaces the GPT collation (samples of seq_length + 1 ids) for datasets that yield whole batches' fields.
    """
    if dataset is None:
        return None
    if eod_mask_loss and eod_token is None:
        raise ConfigError("--eod-mask-loss needs the tokenizer's EOD id (eod_token).")
    sampler = MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                         micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                                         data_parallel_size=data_parallel_size)
    # A private generator: creating the iterator draws a worker base seed, which must not advance the
    # global torch RNG (a resumed run builds its loader after restoring that RNG, an uninterrupted one before).
    # Pinned batches on a GPU machine (Megatron-LM's default): the trainer's non_blocking copy to the device is
    # then truly asynchronous, where from pageable memory it waits for the stream.
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0,
        generator=torch.Generator(), pin_memory=torch.cuda.is_available(),
        collate_fn=collate_fn or functools.partial(collate_gpt_batch, eod_token=eod_token, eod_mask_loss=eod_mask_loss))
    return iter(loader)
