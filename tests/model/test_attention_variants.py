"""The sliding window's and the chunks' masks, the NoPE layers' temperature, and the flags of the attention and RoPE
variants (their numerics are checked against transformers in tests/interop/test_hf_families.py and
test_hf_moe_families.py)."""
import functools
import math

import pytest
import torch

from megatron_lite import kernels
from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.model import dot_product_attention as attention
from megatron_lite.model.attention_temperature import AttentionTemperature
from megatron_lite.model.chunked_attention import ChunkedAttention
from megatron_lite.model.embedding import rotary_freqs
from megatron_lite.model.sliding_window import SlidingWindow, layer_window
from megatron_lite.model.soft_capping import soft_capping
from tests.model.test_gpt_model import LLAMA, build

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


def _visible(mask: torch.Tensor) -> list:
    return [[j for j in range(mask.shape[-1]) if not mask[..., i, j].item()] for i in range(mask.shape[-2])]


def test_chunks_count_from_each_sequences_first_position():
    """Chunks of 3: a packed row of examples of 4 and 3 tokens (the block-diagonal mask given), whose second
    example starts its own chunks; one new token at position 4 after 6 cached keys, two of them left padding."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    examples = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    packed = ((examples[:, None] != examples[None, :]) | torch.ones(7, 7, dtype=torch.bool).triu(1))[None, None]
    mask = ChunkedAttention(3).mask(packed, positions, 7)
    assert _visible(mask) == [[0], [0, 1], [0, 1, 2], [3], [4], [4, 5], [4, 5, 6]]
    padding = torch.tensor([True, True, False, False, False, False, False])[None, None, None, :]
    assert _visible(ChunkedAttention(3).mask(padding, torch.tensor([[4]]), 7)) == [[5, 6]]


def _packed_mask(lengths: list[list[int]]) -> torch.Tensor:
    """[b, 1, s, s], True = may not attend: each row's examples of these lengths, causal within each."""
    examples = torch.tensor([[k for k, n in enumerate(row) for _ in range(n)] for row in lengths])
    seq = examples.shape[1]
    return ((examples[:, :, None] != examples[:, None, :]) | torch.ones(seq, seq, dtype=torch.bool).triu(1))[:, None]


def _restarting(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[p for n in row for p in range(n)] for row in lengths])


_LEFT_PADDED = torch.tensor([[True, True, True] + [False] * 8, [False] * 11])  # two prompts of 8 and 11
# (positions [b, s], mask or None, cached keys before the queries, whether the positions are the key columns)
_CHUNKED_INPUTS = {
    "rows": (torch.arange(11).expand(2, 11), None, 0, True),  # 2 whole chunks of 4 and one of 3
    "whole-chunks": (torch.arange(8).expand(2, 8), None, 0, True),
    "packed": (_restarting([[5, 6], [3, 8]]), _packed_mask([[5, 6], [3, 8]]), 0, False),
    "padding-restarts": (_restarting([[7, 4], [11]]), None, 0, False),  # unpacked --sft: padding counts from 0
    "left-padded": (((~_LEFT_PADDED).cumsum(1) - 1).clamp(min=0),
                    (torch.ones(11, 11, dtype=torch.bool).triu(1) | _LEFT_PADDED[:, None, None, :])
                    & ~torch.eye(11, dtype=torch.bool), 0, False),  # text_generation's prompt mask
    "after-cache": (torch.tensor([[9, 10], [6, 7]]), _LEFT_PADDED[:, None, None, :].expand(2, 1, 2, 11)
                    & ~torch.ones(2, 11, dtype=torch.bool).triu(10), 9, False),
    "one-new-token": (torch.tensor([[10], [10]]), None, 10, True),  # the last of its chunk's 3 keys
    # A context-parallel rank's chunk of the sequence at its global columns 5-10: it starts inside a chunk.
    "after-earlier-keys": (torch.arange(5, 11).expand(2, 6), None, 5, True),
    "after-earlier-keys-packed": (_restarting([[5, 6], [3, 8]])[:, 4:], _packed_mask([[5, 6], [3, 8]])[:, :, 4:],
                                  4, False),
}


def _two_key_prefix(key, value, attention_mask):
    """Prefix tuning's interface (``peft/prefix_tuning.py``): 2 keys and values before the sequence's, seen by every
    query."""
    prefix = torch.linspace(-1, 1, 2 * 2 * 8).view(2, 1, 2, 8).expand(-1, key.shape[1], -1, -1)
    mask = None if attention_mask is None else torch.nn.functional.pad(attention_mask, (2, 0), value=False)
    return torch.cat([prefix, key]), torch.cat([prefix.flip(0), value]), mask


@pytest.mark.parametrize("backend, prefix", [("auto", None), ("unfused", None), ("auto", _two_key_prefix)],
                         ids=["sdpa", "unfused", "sdpa-prefix"])
@pytest.mark.parametrize("case, told", [(case, told) for case, (*_, columns) in _CHUNKED_INPUTS.items()
                                        for told in {False, columns}])
def test_chunk_by_chunk_equals_the_whole_sequence_mask(case, told, backend, prefix):
    """Chunks of 4 over 11 keys, grouped queries (4 heads, 2 groups): the folded form (where the caller tells
    that the positions are the key columns) and the blocked one (always exact) against the core attention under
    one mask over the whole sequence, values and gradients; the core is never handed more than one block's mask
    (C x 2C - 1), and none where the chunks fold."""
    positions, mask, cached, _ = _CHUNKED_INPUTS[case]
    config = ModelConfig(**BASE, num_query_groups=2, attention_backend=backend, attention_dropout=0.0)
    core = functools.partial(attention.DotProductAttention(config, layer_number=0, softmax_scale=0.5,
                                                           heads_per_group=2), prefix=prefix)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(positions.shape[1], 2, 4, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(cached + positions.shape[1], 2, 2, 8, generator=generator, requires_grad=True)
                  for _ in range(2))
    chunks, masks = ChunkedAttention(4), []

    def recorded(*args):
        masks.append(args[3])
        return core(*args)

    blocked = chunks(recorded, query, key, value, mask, positions, positions_are_columns=told)
    whole = core(query, key, value, chunks.mask(mask, positions, key.shape[0]))
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
    weights = torch.randn(whole.shape, generator=generator)
    gradients = [torch.autograd.grad((out * weights).sum(), (query, key, value)) for out in (blocked, whole)]
    for name, ours, reference in zip("qkv", *gradients):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6, msg=name)
    assert all(m is None for m in masks) == told
    assert all(m is None or (m.shape[-2] <= 4 and m.shape[-1] <= 7) for m in masks)


def test_temperature_grows_each_floor_scale_positions():
    query = torch.ones(6, 1, 2, 4)  # [s, b, heads, d]
    tuned = AttentionTemperature(floor_scale=2, scale=0.5)(query, torch.arange(6)[None])
    expected = [1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(3),
                1 + 0.5 * math.log(4)]
    assert tuned[:, 0, 0, 0].tolist() == pytest.approx(expected)


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


@pytest.mark.skipif(not attention.SDPA_HAS_GQA, reason="scaled_dot_product_attention has no enable_gqa before 2.5")
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed-mask"])
def test_grouped_keys_without_copies_equal_the_repeated_keys(packed, monkeypatch):
    """SDPA reading each key/value group for its heads (enable_gqa) against the explicit path that copies the
    groups out with repeat_interleave: same logits, same gradients, causal and with a given (packed) mask."""
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = None
    if packed:  # two examples per row: block-diagonal causal
        block = torch.ones(8, 8, dtype=torch.bool).triu(1)
        mask = torch.ones(16, 16, dtype=torch.bool)
        mask[:8, :8] = mask[8:, 8:] = block
        mask = mask.expand(3, 1, 16, 16)
    sdpa, key_heads = attention.F.scaled_dot_product_attention, []
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: key_heads.append(k.shape[1]) or sdpa(q, k, v, **kw))
    results = []
    for native in (True, False):
        monkeypatch.setattr(attention, "SDPA_HAS_GQA", native)
        model = build(LLAMA)
        loss = model(ids, attention_mask=mask, labels=ids).mean()
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert key_heads == [2, 2, 4, 4]  # 2 layers each: the groups as they are, then copied out per head
    (loss, grads), (repeated_loss, repeated_grads) = results
    torch.testing.assert_close(loss, repeated_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, repeated_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_shared_positions_take_one_row_of_rotary_angles():
    """Samples at the same positions get one row of angles, broadcast over the batch, that rotates queries as
    the per-sample angles do; packed samples (positions restarting) keep a row each."""
    shared = torch.arange(8).expand(3, 8)
    packed = torch.cat([torch.arange(8)[None], torch.arange(8).remainder(4)[None], torch.arange(8)[None]])
    one_row, per_sample = rotary_freqs(shared, 16, 500.0), rotary_freqs(packed, 16, 500.0)
    assert one_row.shape == (8, 1, 1, 16) and per_sample.shape == (8, 3, 1, 16)
    query = torch.randn(8, 3, 2, 16)
    expected = kernels.apply_rotary_pos_emb(query, rotary_freqs(shared[:1], 16, 500.0).expand(8, 3, 1, 16))
    torch.testing.assert_close(kernels.apply_rotary_pos_emb(query, one_row), expected, rtol=0, atol=0)
    torch.testing.assert_close(per_sample[:, 0], one_row[:, 0], rtol=0, atol=0)


MLA = dict(BASE, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_type="yarn"), "--rope-type picks multi-latent attention's"),
    (dict(rotary_scaling_factor=40.0), "--rotary-scaling-factor configure YaRN"),
    (dict(position_embedding_type="yarn", rotary_scaling_factor=0.5), "--rotary-scaling-factor must be >= 1"),
    (dict(position_embedding_type="yarn", use_rope_scaling=True), "give one RoPE scaling"),
    (dict(MLA, num_query_groups=2), "drop --group-query-attention"),
    (dict(MLA, position_embedding_type="learned_absolute"), "needs --position-embedding-type rope"),
    (dict(MLA, rotary_percent=0.5), "no --rotary-percent"),
    (dict(MLA, qk_pos_emb_head_dim=3), "must be even and positive"),
    (dict(MLA, kv_lora_rank=0), "--kv-lora-rank must be positive"),
    (dict(MLA, q_lora_rank=0), "--q-lora-rank must be positive"),
])
def test_bad_latent_attention_and_yarn_settings_are_refused_by_flag(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, **fields})


def test_megatrons_deepseek_v2_lite_flags_build_latent_attention_with_yarn():
    """The attention flags of Megatron-LM's DeepSeek-V2-Lite script (its MoE ones are the MoE layer's): MLA takes
    YaRN by default, --qk-layernorm puts the norms on its latents."""
    from megatron_lite.cli.arguments import parse_args

    config = parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
                        "--mock-data --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type "
                        "rope --multi-latent-attention --kv-lora-rank 32 --v-head-dim 16 --qk-head-dim 16 "
                        "--qk-layernorm --qk-pos-emb-head-dim 8 --rotary-scaling-factor 40 --mscale 0.707 "
                        "--mscale-all-dim 0.707 --yarn-correction-range-round-to-int".split())
    model = config.model
    assert model.yarn and model.rope_type == "yarn" and model.q_lora_rank is None and model.rotary_dim == 8
    assert (model.yarn_original_max_position_embeddings, model.yarn_beta_fast, model.yarn_beta_slow) == (4096, 32, 1)


def test_lora_targets_of_latent_attention():
    """``linear_qkv`` is multi-latent attention's query and key/value projections; a layer it lacks is named."""
    from megatron_lite.config import Config, PeftConfig

    config = Config(model=ModelConfig(**MLA, q_lora_rank=8), peft=PeftConfig(peft="lora"))
    assert config.peft.lora_target_modules == ["linear_proj", "linear_fc1", "linear_fc2", "linear_q_down_proj",
                                               "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"]
    with pytest.raises(ConfigError, match="--lora-target-modules linear_q_proj: this model's linear layers are"):
        Config(model=ModelConfig(**MLA, q_lora_rank=8), peft=PeftConfig(peft="lora", lora_target_modules=[
            "linear_q_proj"]))
    with pytest.raises(ConfigError, match="--lora-target-modules linear_kv_up_proj"):
        Config(model=ModelConfig(**BASE), peft=PeftConfig(peft="lora", lora_target_modules=["linear_kv_up_proj"]))
    with pytest.raises(ConfigError, match="--peft prefix"):
        Config(model=ModelConfig(**MLA), peft=PeftConfig(peft="prefix"))


def test_the_model_folds_its_chunks_where_its_positions_are_the_columns(monkeypatch):
    """The model tells its chunked layers, from the host, whether the positions are the tokens' columns: its own
    (None) and the trainer's arange fold; packed examples' restarting positions take the blocked form."""
    model = build(dict(LLAMA, seq_length=12, attention_chunk_size=4, no_rope_freq="[0, 1]")).eval()
    folded, fold = [], ChunkedAttention._folded

    def recorded(self, *args):
        folded.append(True)
        return fold(self, *args)
    monkeypatch.setattr(ChunkedAttention, "_folded", recorded)
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    restarting = torch.tensor([[p for n in (5, 7) for p in range(n)]] * 2)
    logits = {}
    for name, positions, folds in [("own", None, True), ("given", torch.arange(12).expand(2, 12), True),
                                   ("restarting", restarting, False)]:
        folded.clear()
        logits[name] = model(tokens, positions)
        assert bool(folded) == folds, name
    assert torch.equal(logits["own"], logits["given"]) and not torch.allclose(logits["own"], logits["restarting"])
