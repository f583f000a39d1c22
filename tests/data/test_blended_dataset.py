import math

import numpy as np
import pytest

from megatron_lite.data import build_train_valid_test_datasets
from megatron_lite.data.blended_dataset import build_blending_indices
from megatron_lite.data.dataset_builder import blended_sample_counts
from tests.data.test_gpt_dataset import write_corpus


def megatron_size_per_dataset(weights, target_size, surplus):
    """Megatron-LM's _get_size_per_split_per_dataset for one split."""
    return [int(math.ceil(math.ceil(target_size * weight) * (1 + surplus))) for weight in weights]


def test_blend_sizes_follow_megatron():
    """Each dataset builds ceil(ceil(N * w) * 1.005) samples; the blend is the sum of ceil(N * w) long."""
    assert blended_sample_counts(1000, [1 / 3, 2 / 3]) == ([334, 667], [336, 671])
    for num_samples in [1, 7, 100, 1000, 12_345, 10**7]:
        for weights in [[1 / 3, 2 / 3], [0.3, 0.7], [0.2, 0.3, 0.5], [0.01, 0.99], [1.0]]:
            shares, built = blended_sample_counts(num_samples, weights)
            assert shares == megatron_size_per_dataset(weights, num_samples, 0.0)
            assert built == megatron_size_per_dataset(weights, num_samples, 0.005)


def test_blended_length_is_the_sum_of_the_shares_and_the_margin_can_add_an_epoch(tmp_path):
    # 1,341 tokens of 4-token samples: one epoch holds exactly 335 samples, and dataset a owes
    # ceil(ceil(1000 / 3) * 1.005) = 336, so it needs a second epoch (ceil(1000 / 3 * 1.005) = 335 would not).
    a = write_corpus(tmp_path / "a", [20] * 66 + [21])
    b = write_corpus(tmp_path / "b", [30] * 300, first_token=1_000_000)
    train, _, _ = build_train_valid_test_datasets(data_path=["1", a, "2", b], split="1", seq_length=4, seed=7,
                                                  train_valid_test_num_samples=(1000, 0, 0))
    assert len(train) == 1001 and len(train.dataset_index) == 1001
    assert len(train.datasets[0].document_index) == 2 * 67
    counts = np.bincount(train.dataset_index)
    assert counts.tolist() == [334, 667]
    np.testing.assert_array_equal((train.dataset_index, train.dataset_sample_index),
                                  build_blending_indices([1 / 3, 2 / 3], 1001))
    # One weighted prefix is a blend of one (as in Megatron-LM): its dataset builds ceil(N * 1.005) samples.
    single, _, _ = build_train_valid_test_datasets(data_path=["1", a], split="1", seq_length=4, seed=7,
                                                   train_valid_test_num_samples=(334, 0, 0))
    plain, _, _ = build_train_valid_test_datasets(data_path=[a], split="1", seq_length=4, seed=7,
                                                  train_valid_test_num_samples=(334, 0, 0))
    assert len(single) == 334 and len(single.datasets[0].document_index) == 2 * 67
    assert len(plain.document_index) == 67


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.3, 0.5], [0.01, 0.99]])
def test_greedy_blend_tracks_the_weights_at_every_prefix(weights):
    size = 10_000
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    counts = np.stack([np.cumsum(dataset_index == k) for k in range(len(weights))], axis=1)
    expected = np.arange(1, size + 1)[:, None] * np.array(weights)[None, :]
    assert np.abs(counts - expected).max() <= 1.0  # within one sample of the target share, always
    for k in range(len(weights)):  # each dataset's samples are used in order, each once
        assert np.array_equal(dataset_sample_index[dataset_index == k], np.arange(counts[-1, k]))


def test_blended_corpora_follow_the_weights_within_one_percent(tmp_path):
    rng = np.random.default_rng(0)
    a = write_corpus(tmp_path / "a", rng.integers(5, 50, size=100))  # tokens below 1,000,000
    b = write_corpus(tmp_path / "b", rng.integers(5, 50, size=300), first_token=1_000_000)
    train, valid, test = build_train_valid_test_datasets(
        data_path=["0.3", a, "0.7", b], split="90,10,0", seq_length=16, seed=1234,
        train_valid_test_num_samples=(10_000, 500, 100))
    assert len(train) == 10_000 and len(valid) == 500 and test is None
    from_b = np.array([train[i]["tokens"][0] >= 1_000_000 for i in range(len(train))])
    assert abs(from_b.mean() - 0.7) < 0.01
    # Corpus a (about 2,700 tokens, 170 samples an epoch) is repeated for the 3,000-odd samples it owes.
    assert len(train.datasets[0]) >= 3015 and len(train.datasets[0].document_index) > 10 * 100


def test_a_corpus_without_documents_in_a_split_drops_out_of_that_split(tmp_path):
    a = write_corpus(tmp_path / "a", [10] * 100)
    b = write_corpus(tmp_path / "b", [10] * 2, first_token=1_000_000)  # 2 documents: none in valid
    train, valid, _ = build_train_valid_test_datasets(data_path=["1", a, "1", b], split="80,20,0", seq_length=4,
                                                      seed=0, train_valid_test_num_samples=(100, 40, 0))
    assert len(train.datasets) == 2 and len(valid.datasets) == 1
    assert all(valid[i]["tokens"].max() < 1_000_000 for i in range(len(valid)))
