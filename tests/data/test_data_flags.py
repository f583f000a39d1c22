"""The data flags of Megatron-LM's scripts reach the loader: --data-cache-path, --no-mmap-bin-files, --num-workers."""
import os

import numpy as np
import torch

from megatron_lite.config.arguments import parse_args
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.training.data_iterators import build_data_iterators
from tests.data.test_gpt_dataset import write_corpus


def _iterators(prefix, *flags):
    config = parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                         "--vocab-size", "10000", "--data-path", prefix, "--split", "90,10,0", "--micro-batch-size",
                         "2", "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "1", *flags])
    return build_data_iterators(config, initialize_model_parallel(1, 1), consumed_train_samples=0)


def test_data_flags_reach_the_loader_and_change_no_sample(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", np.random.default_rng(0).integers(1, 40, size=100))
    cache = tmp_path / "elsewhere"  # not the default, {corpus directory}/cache
    plain, _ = _iterators(prefix)
    flagged, _ = _iterators(prefix, "--data-cache-path", str(cache), "--no-mmap-bin-files", "--num-workers", "2")
    assert flagged._num_workers == 2 and plain._num_workers == 0
    assert flagged._dataset.indexed_dataset.mmap is False and plain._dataset.indexed_dataset.mmap is True
    assert {"GPTDataset-train", "GPTDataset-valid"} <= {name.split("-", 1)[1].rsplit("-", 1)[0]
                                                       for name in os.listdir(cache)}
    for a, b in zip(plain, flagged, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
