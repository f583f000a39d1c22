"""The sliding window's mask and the flags of the attention and RoPE variants (their numerics are checked
against transformers in tests/checkpointing/test_hf_families.py)."""
import pytest
import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.model.sliding_window import SlidingWindow

BASE = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
            position_embedding_type="rope")


def test_window_sees_itself_and_left_keys_before_it():
    mask = SlidingWindow(2).mask(None, 5, 5, "cpu")  # True = may not attend
    visible = [[j for j in range(5) if not mask[i, j]] for i in range(5)]
    assert visible == [[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]


def test_window_after_cached_keys_and_with_a_given_mask():
    """One new token after 5 cached ones is key position 5; a padding mask is kept."""
    padding = torch.tensor([True, False, False, False, False, False])[None, None, None, :]
    mask = SlidingWindow(2).mask(padding, 1, 6, "cpu")
    assert mask[0, 0, 0].tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("fields,message", [
    (dict(window_size=[4, 2]), "--window-size takes LEFT 0"),
    (dict(rotary_seq_len_interpolation_factor=2.0, use_rope_scaling=True), "give one RoPE scaling"),
    (dict(rotary_seq_len_interpolation_factor=0.5), "must be >= 1"),
    (dict(use_rope_scaling=True, position_embedding_type="learned_absolute"), "need --position-embedding-type rope"),
])
def test_bad_variant_settings_are_refused_by_flag(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, **fields})
