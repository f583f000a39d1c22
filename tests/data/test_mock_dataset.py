import numpy as np
import pytest

from megatron_lite.data import MockGPTDataset


def test_sample_depends_only_on_seed_and_index():
    a = MockGPTDataset(vocab_size=512, seq_length=32, seed=3, num_samples=100)
    b = MockGPTDataset(vocab_size=512, seq_length=32, seed=3, num_samples=5000)
    forward = [a[i]["tokens"] for i in range(100)]
    for i in reversed(range(100)):
        assert np.array_equal(b[i]["tokens"], forward[i])
    c = MockGPTDataset(vocab_size=512, seq_length=32, seed=4, num_samples=100)
    assert sum(np.array_equal(c[i]["tokens"], forward[i]) for i in range(100)) == 0
    assert all(t.dtype == np.int64 and t.shape == (33,) and 0 <= t.min() and t.max() < 512 for t in forward)
    with pytest.raises(IndexError):
        a[100]


def test_tokens_follow_a_learnable_rule():
    """Each sample is an arithmetic progression or a repeated motif: the next token is predictable."""
    dataset = MockGPTDataset(vocab_size=300, seq_length=64, seed=0, num_samples=200)
    kinds = {"progression": 0, "motif": 0}
    for i in range(len(dataset)):
        tokens = dataset[i]["tokens"]
        steps = np.diff(tokens) % 300
        if np.all(steps == steps[0]) and steps[0] != 0:
            kinds["progression"] += 1
        else:
            period = next(p for p in range(2, 9) if np.array_equal(tokens[p:], tokens[:-p]))
            assert period >= 2
            kinds["motif"] += 1
    assert min(kinds.values()) > 60
