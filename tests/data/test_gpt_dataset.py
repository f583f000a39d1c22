import functools
import os
import re
import threading
import time

import numpy as np
import pytest

from megatron_lite.config import ConfigError

from megatron_lite.data import build_train_valid_test_datasets, parse_data_path, parse_split
from megatron_lite.data.dataset_builder import split_document_boundaries
from megatron_lite.data.gpt_dataset import build_document_index, build_sample_index, num_epochs_needed
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder


def write_corpus(prefix, lengths, first_token=0):
    """Documents whose tokens are consecutive integers, so every token says where it came from."""
    with IndexedDatasetBuilder(f"{prefix}.bin", np.int32) as builder:
        token = first_token
        for length in lengths:
            builder.add_document(np.arange(token, token + length))
            token += length
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def reference_sample_index(lengths, document_index, seq_length, num_samples):
    """Megatron-LM's sample-index loop, token by token."""
    rows, position, offset = [(0, 0)], 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining:
            available = lengths[document_index[position]] - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


@pytest.fixture
def corpus(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 60, size=200)
    return write_corpus(tmp_path / "c", lengths), lengths


def test_num_epochs_is_the_smallest_sufficient():
    for tokens, seq, samples in [(1000, 10, 99), (1000, 10, 100), (1000, 10, 1000), (7, 3, 50), (5, 100, 0)]:
        epochs = num_epochs_needed(tokens, seq, samples)
        assert (epochs * tokens - 1) // seq >= samples
        assert epochs == 1 or ((epochs - 1) * tokens - 1) // seq < samples


@pytest.mark.parametrize("shortest", [1, 0])
def test_sample_index_matches_megatron_loop(shortest):
    """Also with empty sequences (a file another tool wrote), including at the start of the document index."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(shortest, 40, size=300)
    document_index = rng.permutation(np.tile(np.arange(300), 2))
    if shortest == 0:  # empty documents drawn at random, and three more leading and two trailing
        lengths[:5] = 0
        document_index = np.concatenate([[0, 1, 2], document_index, [3, 4]])
    for seq_length in (1, 7, 39, 40, 128):
        num_samples = (int(lengths.sum()) * 2 - 1) // seq_length
        ours = build_sample_index(lengths, document_index, seq_length, num_samples)
        np.testing.assert_array_equal(ours, reference_sample_index(lengths, document_index, seq_length, num_samples))


def test_samples_are_consecutive_tokens_and_one_epoch_drops_or_repeats_none(corpus):
    prefix, lengths = corpus
    seq_length, total = 32, int(lengths.sum())
    num_samples = (total - 1) // seq_length  # everything one epoch can give
    train, _, _ = build_train_valid_test_datasets(data_path=[prefix], split="1", seq_length=seq_length, seed=5,
                                                  train_valid_test_num_samples=(num_samples, 0, 0))
    assert len(train) == num_samples and len(np.unique(train.document_index)) == 200
    stream = np.concatenate([np.arange(lengths[:d].sum(), lengths[:d + 1].sum()) for d in train.document_index])
    samples = [train.unshuffled_sample(s) for s in range(num_samples)]
    for s, tokens in enumerate(samples):
        assert tokens.dtype == np.int64 and len(tokens) == seq_length + 1
        np.testing.assert_array_equal(tokens, stream[s * seq_length:(s + 1) * seq_length + 1])
    used = np.concatenate([samples[0][:1]] + [tokens[1:] for tokens in samples])
    assert len(np.unique(used)) == len(used) == num_samples * seq_length + 1  # nothing repeated
    assert total - len(used) < seq_length  # only the tail too short for a sample is unused
    assert sorted(train.shuffle_index.tolist()) == list(range(num_samples))
    assert not np.array_equal(train.shuffle_index, np.arange(num_samples))
    for i in (0, 1, num_samples - 1):
        np.testing.assert_array_equal(train[i]["tokens"], samples[train.shuffle_index[i]])
    with pytest.raises(IndexError):
        train[num_samples]


def test_several_epochs_use_every_document_each_epoch(corpus):
    prefix, lengths = corpus
    seq_length, per_epoch = 16, (int(lengths.sum()) - 1) // 16
    for num_samples, separate in [(int(2.95 * per_epoch), False), (int(2.2 * per_epoch), True)]:
        train, _, _ = build_train_valid_test_datasets(data_path=[prefix], split="1", seq_length=seq_length, seed=3,
                                                      train_valid_test_num_samples=(num_samples, 0, 0))
        assert len(train) >= num_samples and len(train.document_index) == 3 * 200
        assert np.array_equal(np.bincount(train.document_index), np.full(200, 3))
        # A last epoch used under 80% is shuffled on its own: its 200 entries are one full epoch.
        assert (sorted(train.document_index[400:].tolist()) == list(range(200))) == separate
        if separate:  # ... and the samples of the first two epochs are shuffled apart from it
            first = ((2 * int(lengths.sum())) - 1) // seq_length
            assert sorted(train.shuffle_index[:first].tolist()) == list(range(first))


def test_document_index_is_deterministic_in_the_seed():
    documents = np.arange(10, 50)
    first = build_document_index(documents, 2, np.random.RandomState(7), False)
    assert np.array_equal(first, build_document_index(documents, 2, np.random.RandomState(7), False))
    assert not np.array_equal(first, build_document_index(documents, 2, np.random.RandomState(8), False))
    expected = np.tile(documents, 2).astype(np.int32)
    np.random.RandomState(7).shuffle(expected)  # Megatron: numpy's RandomState(seed) shuffle of the epochs
    assert np.array_equal(first, expected)


def megatron_split_bookends(num_elements, split):
    """Megatron-LM's parse_and_normalize_split and convert_split_vector_to_split_matrix, then the
    builder's round(bookend * num_elements) for each split's [begin, end)."""
    vector = [float(x) for x in re.findall(r"[.0-9]+", split)]
    vector = (np.array(vector + [0.0] * (3 - len(vector))) / np.sum(vector)).tolist()
    expansion = functools.reduce(lambda a, b: a + [a[-1] + b], [[0], *vector])
    return [(int(round(begin * float(num_elements))), int(round(end * float(num_elements))))
            for begin, end in zip(expansion[:-1], expansion[1:])]


def test_split_boundaries():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == [0.98, 0.02, 0.0]
    assert split_document_boundaries(1000, parse_split("969,30,1")) == [0, 969, 999, 1000]
    # Megatron rounds the cumulative fractions: 0.969 * 49 = 47.48 -> train [0, 47) (rounding each part gave 48).
    assert split_document_boundaries(49, parse_split("969,30,1")) == [0, 47, 49, 49]
    assert split_document_boundaries(10, parse_split("45,45,10")) == [0, 4, 9, 10]  # 4.5 rounds half to even
    assert split_document_boundaries(7, parse_split("1")) == [0, 7, 7, 7]
    for split in ["969,30,1", "98,2", "80,15,5", "1,1,1", "45,45,10", "90,5,5", "2,1", "0.7,0.2,0.1", "1,0,1"]:
        for num_documents in range(1, 400):
            ours = split_document_boundaries(num_documents, parse_split(split))
            assert list(zip(ours[:-1], ours[1:])) == megatron_split_bookends(num_documents, split), (split,
                                                                                                    num_documents)
    for bad in ["a,b", "1,2,3,4", "0,0,0", "-1,2"]:
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_splits_use_disjoint_document_ranges(corpus):
    prefix, lengths = corpus
    starts = np.concatenate([[0], np.cumsum(lengths)])
    datasets = build_train_valid_test_datasets(data_path=[prefix], split="80,15,5", seq_length=8, seed=1,
                                               train_valid_test_num_samples=(200, 50, 20))
    for dataset, (first, stop) in zip(datasets, [(0, 160), (160, 190), (190, 200)]):
        tokens = np.concatenate([dataset[i]["tokens"] for i in range(len(dataset))])
        assert starts[first] <= tokens.min() and tokens.max() < starts[stop]
        assert sorted(set(dataset.document_index.tolist())) == list(range(first, stop))
    train, valid, test = build_train_valid_test_datasets(data_path=[prefix], split="100,0,0", seq_length=8, seed=1,
                                                         train_valid_test_num_samples=(10, 10, 10))
    assert train is not None and valid is None and test is None


def test_split_counts_sequences_so_empty_documents_take_no_share(tmp_path):
    """49 non-empty documents and 3 empty ones (no sequence): --split 969,30,1 gives train the first 47."""
    with IndexedDatasetBuilder(f"{tmp_path / 'c'}.bin", np.int32) as builder:
        for document in range(52):
            builder.add_document([] if document in (0, 20, 51) else np.full(10, document))
        builder.finalize(f"{tmp_path / 'c'}.idx")
    train, valid, test = build_train_valid_test_datasets(data_path=[str(tmp_path / "c")], split="969,30,1",
                                                         seq_length=8, seed=1, train_valid_test_num_samples=(50, 2, 1))
    assert sorted(set(train.document_index.tolist())) == list(range(47)) and test is None
    assert sorted(set(valid.document_index.tolist())) == [47, 48]
    assert sorted(set(np.concatenate([train[i]["tokens"] for i in range(len(train))]).tolist())) == sorted(
        set(range(1, 49)) - {20})  # sequences 47 and 48 (valid) are documents 49 and 50


def test_indices_are_cached_and_loaded_by_other_ranks(corpus, tmp_path):
    prefix, _ = corpus
    kwargs = dict(data_path=[prefix], split="1", seq_length=8, seed=1, train_valid_test_num_samples=(100, 0, 0),
                  data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(TimeoutError, match="builder rank"):
        build_train_valid_test_datasets(**kwargs, is_builder_rank=False, cache_wait_timeout_s=0.3)

    waiter_result = {}
    waiter = threading.Thread(target=lambda: waiter_result.update(
        train=build_train_valid_test_datasets(**kwargs, is_builder_rank=False, cache_wait_timeout_s=30)[0]))
    waiter.start()  # a non-builder rank that arrives first and waits for the files
    time.sleep(0.3)
    built, _, _ = build_train_valid_test_datasets(**kwargs, is_builder_rank=True)
    waiter.join()
    loaded = waiter_result["train"]
    assert isinstance(loaded.shuffle_index, np.memmap)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(built, name), getattr(loaded, name))
    cached = sorted(os.listdir(tmp_path / "cache"))
    assert len(cached) == 4 and not any(".tmp" in name for name in cached)

    other_seed, _, _ = build_train_valid_test_datasets(**{**kwargs, "seed": 2})
    assert len(os.listdir(tmp_path / "cache")) == 8 and not np.array_equal(other_seed.shuffle_index,
                                                                            built.shuffle_index)


def test_data_path_parsing_errors():
    assert parse_data_path(["a"]) == ([1.0], ["a"])
    assert parse_data_path(["1", "a", "3", "b"]) == ([0.25, 0.75], ["a", "b"])
    for bad, message in [([], "empty"), (["1", "a", "b"], "alternate weight and prefix"),
                         (["x", "a", "y", "b"], "must be numbers"), (["-1", "a", "2", "b"], "non-negative")]:
        with pytest.raises(ValueError, match=message):
            parse_data_path(bad)


def test_a_split_too_small_for_one_sample_is_reported(tmp_path, capsys):
    """A test or validation split without one sample is skipped with a notice; a train split is an error."""
    prefix = write_corpus(tmp_path / "tiny", [5] * 99 + [1])
    datasets = build_train_valid_test_datasets(data_path=[prefix], split="98,1,1", seq_length=4, seed=0,
                                               train_valid_test_num_samples=(10, 10, 10))
    assert datasets[2] is None and "notice:" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"the train split .* holds fewer than 2 tokens.*--split"):
        build_train_valid_test_datasets(data_path=[write_corpus(tmp_path / "short", [1] + [5] * 99)], split="1,0,99",
                                        seq_length=4, seed=0,
                                        train_valid_test_num_samples=(10, 10, 10))
