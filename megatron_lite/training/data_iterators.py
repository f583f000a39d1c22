"""The micro-batch iterators the loop reads: train, validation and test, positioned for a resume."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_lite.config import Config, ConfigError, TrainingConfig
from megatron_lite.context_parallel import slice_batches
from megatron_lite.data import MockGPTDataset, build_pretraining_data_loader, build_train_valid_test_datasets
from megatron_lite.data.dataset_builder import parse_data_path
from megatron_lite.data.indexed_dataset import IndexedDataset, data_file_path, output_prefix_for
from megatron_lite.data.sft import RecordFormat, SFTDataset, load_sft_examples
from megatron_lite.data.sft.examples import TOKENS_KEY, is_preprocessed_sft
from megatron_lite.data.sft.preference import PreferenceDataset, load_preference_pairs
from megatron_lite.data.vocab_check import check_token_ids
from megatron_lite.process_groups import failures
from megatron_lite.process_groups.parallel_state import ParallelState
from megatron_lite.tokenizer import build_model_tokenizer
from megatron_lite.training.logger import print_rank_last
from megatron_lite.training.num_microbatches_calculator import NumMicroBatchesCalculator
from megatron_lite.training.run_plan import RunPlan


def build_data_iterators(config: Config, parallel_state: ParallelState, plan: RunPlan, consumed_train_samples: int,
                         iteration: int = 0):
    """(train, valid, test) micro-batch iterators positioned where ``iteration`` iterations left them (so a
    resumed run continues with the same samples); a list of them, one per chunk, when interleaving. Test
    data is read once, after training: only fine-tuning's --test-data-path gives it. The context-parallel
    ranks of a data-parallel rank read the same micro-batches, each cut to its own positions.

    Fourth: ``tokens_in(n)``, the tokens the first n training samples feed through the model (padding of
    --sft samples left out), which throughput counts."""
    datasets = build_datasets(config, plan)
    return (*positioned_iterators(config, parallel_state, datasets, consumed_train_samples, iteration),
            tokens_counter(config, datasets[0]))


def build_datasets(config: Config, plan: RunPlan) -> tuple:
    """The run's (train, valid, test) datasets, sized for the samples it reads (None where a split is absent)."""
    num_samples = _num_samples(config.training, plan.calculator, plan.train_iters)
    if config.data.sft:
        train_ds, valid_ds, test_ds = _build_sft_datasets(config, num_samples)
    else:
        (train_ds, valid_ds), test_ds = _build_datasets(config, num_samples, plan.train_iters)[:2], None
    print_rank_last(f" data: train {train_ds.describe() if train_ds else 'none'} | "
                    f"validation {valid_ds.describe() if valid_ds else 'none'}"
                    + (f" | test {test_ds.describe()}" if test_ds else ""))
    return train_ds, valid_ds, test_ds


def positioned_iterators(config: Config, parallel_state: ParallelState, datasets: tuple, consumed_train_samples: int,
                         iteration: int = 0) -> tuple:
    """(train, valid, test) micro-batch iterators over ``datasets`` (``build_data_iterators``'); called again, a
    second set over the same micro-batches (what --dpo-precompute-ref-log-probs scores ahead of training)."""
    training, data = config.training, config.data
    global_batch = training.global_batch(parallel_state.data_parallel_world_size)
    consumed_valid_samples = (iteration // training.eval_interval) * training.eval_iters * global_batch
    eod_token = None
    if data.eod_mask_loss:
        eod_token = build_model_tokenizer(dataclasses.asdict(data), config.model.vocab_size).eod
    vpp = config.parallel.virtual_pipeline_model_parallel_size or 1
    # SFT samples are whole fields already (tokens, labels, masks), which the default collation stacks.
    collate_fn = torch.utils.data.default_collate if data.sft else None

    def loaders(dataset, consumed):
        if dataset is None:
            return None
        made = [slice_batches(build_pretraining_data_loader(
            dataset, consumed_samples=consumed, micro_batch_size=training.micro_batch_size,
            data_parallel_rank=parallel_state.data_parallel_rank,
            data_parallel_size=parallel_state.data_parallel_world_size,
            eod_token=eod_token, eod_mask_loss=data.eod_mask_loss, num_workers=data.num_workers,
            collate_fn=collate_fn), parallel_state.context_parallel_rank, parallel_state.context_parallel_world_size)
            for _ in range(vpp)]
        return made if vpp > 1 else made[0]

    train_ds, valid_ds, test_ds = datasets
    return loaders(train_ds, consumed_train_samples), loaders(valid_ds, consumed_valid_samples), loaders(test_ds, 0)


def tokens_counter(config: Config, train_ds):
    """``tokens_in(n)``: the tokens of the first n training samples (a fine-tuning set's without padding)."""
    seq_length = config.model.seq_length
    return train_ds.tokens_in if isinstance(train_ds, SFTDataset) else lambda samples: samples * seq_length


def _num_samples(training: TrainingConfig, calculator: NumMicroBatchesCalculator,
                 train_iters: int) -> tuple[int, int, int]:
    """Samples each split is built for (train, valid, test), as Megatron asks for them: --train-samples
    or --train-iters x global batch, and --eval-iters global batches per evaluation. Never fewer
    training samples than the run consumes (the last iteration of a growing batch may pass --train-samples)."""
    global_batch = calculator.global_batch_size
    requested = training.train_samples if training.train_samples is not None else train_iters * global_batch
    num_evaluations = train_iters // training.eval_interval + 1
    return (max(requested, calculator.consumed_samples_after(train_iters)),
            num_evaluations * training.eval_iters * global_batch, training.eval_iters * global_batch)


def _build_sft_datasets(config: Config, num_samples: tuple):
    """Fine-tuning datasets from --train-data-path, --valid-data-path and --test-data-path (None where absent)."""
    data = config.data
    tokenizer = build_model_tokenizer(dataclasses.asdict(data), config.model.vocab_size)
    record_format = RecordFormat.from_flags(data.sft_format, data.sft_data_keys)
    datasets = []
    for paths, count in zip((data.train_data_path, data.valid_data_path, data.test_data_path), num_samples):
        if not paths or count <= 0:
            datasets.append(None)
            continue
        check_preprocessed_sft_token_ids(paths, config.model.vocab_size)
        if data.dpo:
            pairs = load_preference_pairs(paths, tokenizer, data.sft_tokenizer_prompt_format)
            datasets.append(PreferenceDataset(pairs, seq_length=config.model.seq_length, num_samples=count,
                                              seed=config.training.seed, pad_token=tokenizer.pad,
                                              pack_sequences=data.sft_pack_sequences))
            continue
        examples = load_sft_examples(paths, tokenizer, data.sft_tokenizer_prompt_format, record_format)
        datasets.append(SFTDataset(examples, seq_length=config.model.seq_length, num_samples=count,
                                   seed=config.training.seed, pad_token=tokenizer.pad,
                                   pack_sequences=data.sft_pack_sequences))
    return tuple(datasets)


def _build_datasets(config: Config, num_samples: tuple, train_iters: int):
    model, training, data = config.model, config.training, config.data
    if data.mock_data:
        return tuple(MockGPTDataset(vocab_size=model.vocab_size, seq_length=model.seq_length,
                                    seed=training.seed + split, num_samples=n) if n > 0 else None
                     for split, n in enumerate(num_samples))
    is_builder = not dist.is_initialized() or dist.get_rank() == 0
    kwargs = dict(data_path=data.data_path, split=data.split, seq_length=model.seq_length, seed=training.seed,
                  train_valid_test_num_samples=num_samples, data_cache_path=data.data_cache_path,
                  mmap_bin_files=data.mmap_bin_files)
    # One rank builds the sample indices and caches them; the others then load the cache. If the
    # builder fails (a bad --data-path), every rank raises instead of waiting for its cache.
    datasets = failures.run_on_every_rank(
        lambda: _build_checked_datasets(kwargs, model.vocab_size) if is_builder else None, "build the datasets")
    if not is_builder:
        datasets = build_train_valid_test_datasets(is_builder_rank=False, **kwargs)
    _check_splits(config, datasets, train_iters)
    return datasets


def _build_checked_datasets(kwargs: dict, vocab_size: int):
    """The builder rank's datasets, once every --data-path file's ids are checked to fit the vocabulary."""
    for prefix in parse_data_path(kwargs["data_path"])[1]:
        check_token_ids(IndexedDataset(prefix).all_tokens(), vocab_size, data_file_path(prefix))
    return build_train_valid_test_datasets(is_builder_rank=True, **kwargs)


def check_preprocessed_sft_token_ids(paths: list[str], vocab_size: int) -> None:
    """Preprocessed fine-tuning ids fit the vocabulary (JSONL is tokenized now, by a tokenizer checked to fit)."""
    for path in paths:
        if is_preprocessed_sft(path):
            prefix = output_prefix_for(path, TOKENS_KEY)
            check_token_ids(IndexedDataset(prefix).all_tokens(), vocab_size, data_file_path(prefix))


def _check_splits(config: Config, datasets: tuple, train_iters: int) -> None:
    """An empty train split fails here, at start-up; a missing validation split is said, not silent."""
    data, training = config.data, config.training
    if datasets[0] is None and train_iters > 0:
        raise ConfigError(f"no training data: --split {data.split} gives the train split no documents of "
                          f"--data-path {' '.join(data.data_path)}; raise its first weight.")
    if datasets[1] is None and training.eval_iters > 0 and training.eval_interval <= train_iters:
        print_rank_last(f" notice: no validation data (--split {data.split} leaves the validation split empty); "
                        "validation is skipped. Give it documents with --split to see a validation loss.")
