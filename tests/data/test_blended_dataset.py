import numpy as np
import pytest

from megatron_lite.data import build_train_valid_test_datasets
from megatron_lite.data.blended_dataset import build_blending_indices
from tests.data.test_gpt_dataset import write_corpus


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
