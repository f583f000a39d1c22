"""The sliding window's mask and the flags of the attention and RoPE variants (their numerics are checked
against transformers in tests/checkpointing/test_hf_families.py)."""
import pytest
import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.model.sliding_window import SlidingWindow, layer_window
from megatron_lite.model.soft_capping import soft_capping

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


def test_every_nth_layer_attends_globally():
    config = ModelConfig(**dict(BASE, num_layers=4), window_size=[3, 0], window_attn_skip_freq=2)
    assert [layer_window(config, i) is None for i in range(4)] == [False, True, False, True]  # 1-based N-th
    assert layer_window(ModelConfig(**BASE), 0) is None


def test_soft_capping_bounds_and_keeps_small_values():
    cap = soft_capping(5.0)
    x = torch.tensor([-1e4, -0.01, 0.0, 0.01, 1e4])
    torch.testing.assert_close(cap(x), 5.0 * torch.tanh(x / 5.0))
    assert cap(x).abs().max() <= 5.0 and soft_capping(None) is None


@pytest.mark.parametrize("flags, message", [
    (dict(geglu=True), "--geglu changes the gate of --swiglu"),
    (dict(window_attn_skip_freq=2), "--window-attn-skip-freq"),
    (dict(rotary_base_local=100.0), "--rotary-base-local is the RoPE base of the sliding-window layers"),
    (dict(rotary_base_local=-1.0, window_size=[3, 0]), "--rotary-base-local must be positive"),
    (dict(attn_logit_softcapping=0.0), "--attn-logit-softcapping must be positive"),
    (dict(softmax_scale=-1.0), "--softmax-scale must be positive")])
def test_gemma_flags_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**BASE, **flags)
