"""The data flags of Megatron-LM's scripts reach the loader: --data-cache-path, --no-mmap-bin-files, --num-workers,
and --eod-mask-loss masks the EOD that generation stops at."""
import os

import numpy as np
import torch

from megatron_lite.cli.arguments import parse_args
from megatron_lite.data import IndexedDatasetBuilder
from megatron_lite.inference.loading import checkpoint_tokenizer
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.training.data_iterators import build_data_iterators
from megatron_lite.training.run_plan import plan_run
from tests.data.test_gpt_dataset import write_corpus


def _config(prefix, *flags, vocab_size=10000):
    return parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                       "--vocab-size", str(vocab_size), "--data-path", prefix, "--split", "90,10,0",
                       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "1",
                       *flags])


def _iterators(prefix, *flags, config=None):
    config = config or _config(prefix, *flags)
    parallel_state = initialize_model_parallel(1, 1)
    return build_data_iterators(config, parallel_state, plan_run(config, parallel_state), consumed_train_samples=0)


def test_data_flags_reach_the_loader_and_change_no_sample(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", np.random.default_rng(0).integers(1, 40, size=100))
    cache = tmp_path / "elsewhere"  # not the default, {corpus directory}/cache
    plain = _iterators(prefix)[0]
    flagged = _iterators(prefix, "--data-cache-path", str(cache), "--no-mmap-bin-files", "--num-workers", "2")[0]
    assert flagged._num_workers == 2 and plain._num_workers == 0
    assert flagged._dataset.indexed_dataset.mmap is False and plain._dataset.indexed_dataset.mmap is True
    assert {"GPTDataset-train", "GPTDataset-valid"} <= {name.split("-", 1)[1].rsplit("-", 1)[0]
                                                       for name in os.listdir(cache)}
    for a, b in zip(plain, flagged, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def test_null_tokenizer_eod_is_the_model_vocabularys_last_id_in_training_and_generation(tmp_path):
    """preprocess_data --vocab-size 40 writes EOD 40; a model of --vocab-size 41 masks it and stops at it."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(f"{tmp_path / 'corpus'}.bin", np.int32) as builder:
        for length in rng.integers(1, 6, size=40):
            builder.add_document(np.append(rng.integers(0, 40, size=length), 40))
        builder.finalize(f"{tmp_path / 'corpus'}.idx")
    config = _config(str(tmp_path / "corpus"), "--tokenizer-type", "NullTokenizer", "--eod-mask-loss", vocab_size=41)
    assert checkpoint_tokenizer(config, {}).eod == 40
    batch = next(iter(_iterators(None, config=config)[0]))
    assert (batch["tokens"] == 40).any()
    assert torch.equal(batch["loss_mask"] == 0, batch["tokens"] == 40)
