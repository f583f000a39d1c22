"""How many samples one pass over the training data is: what --train-epochs multiplies.

    pretraining (one --data-path)   the train split's samples, (tokens - 1) // seq_length: a sample is
                                    seq_length + 1 tokens and consecutive samples share one
                                    (docs/reference.md section 2)
    --sft, padded                   the training examples, one per sample
    --sft --sft-pack-sequences      the packed sequences of the first pass (each pass packs the examples
                                    in its own order, so later ones may differ by a few)

A blend of corpora has no single epoch (each is read by its weight, its passes at their own pace), and
--mock-data no size: both are refused with the flags that do apply.
"""
from __future__ import annotations

import dataclasses
import functools

from megatron_lite.config import Config, ConfigError
from megatron_lite.data.dataset_builder import parse_data_path, parse_split, split_document_boundaries
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.sft import RecordFormat, load_sft_examples
from megatron_lite.data.sft.examples import count_sft_examples
from megatron_lite.data.sft.sft_dataset import EpochLayout, example_positions, next_fit_bins
from megatron_lite.tokenizer import build_model_tokenizer


def samples_per_epoch(config: Config) -> int:
    """The samples of one pass over ``config``'s training data; raises ConfigError where there is no such pass."""
    data, seq_length = config.data, config.model.seq_length
    if data.dpo:  # a pair is two sequences, and packed pairs fill a sample by their sizes: not counted yet
        raise ConfigError("--train-epochs does not count --dpo's preference pairs yet: give --train-iters or "
                          "--train-samples (a pair is two samples).")
    if data.grpo:
        raise ConfigError("--train-epochs does not count --grpo's batches of completions: give --train-iters or "
                          "--train-samples (a completion is a sample).")
    if data.sft:
        return _sft_samples(config)
    if data.mock_data:
        raise ConfigError("--train-epochs counts passes over the training data, and --mock-data has no size: give "
                          "--train-iters or --train-samples.")
    _, prefixes = parse_data_path(data.data_path)
    if len(prefixes) > 1:
        raise ConfigError(f"--train-epochs counts passes over one dataset, but --data-path blends {len(prefixes)}, "
                          f"each read by its weight: give --train-samples (or --train-iters) instead.")
    lengths = IndexedDataset(prefixes[0]).sequence_lengths
    start, stop = split_document_boundaries(len(lengths), parse_split(data.split))[:2]
    return max(int(lengths[start:stop].sum()) - 1, 0) // seq_length


def _sft_samples(config: Config) -> int:
    data = config.data
    record_format = RecordFormat.from_flags(data.sft_format, data.sft_data_keys)
    if not data.sft_pack_sequences:
        return count_sft_examples(data.train_data_path, record_format)
    tokenizer = build_model_tokenizer(dataclasses.asdict(data), config.model.vocab_size)
    examples = load_sft_examples(data.train_data_path, tokenizer, data.sft_tokenizer_prompt_format, record_format)
    positions = example_positions(examples.lengths, config.model.seq_length)
    first_pass = EpochLayout(positions, num_samples=1, seed=config.training.seed,
                             bins=functools.partial(next_fit_bins, capacity=config.model.seq_length))
    return len(first_pass.bin_starts[0]) - 1
