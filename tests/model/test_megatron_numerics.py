"""The numerics flags of Megatron-LM's example scripts, against independent implementations.

--rotary-percent against transformers' GPT-NeoX (partial rotary), --apply-layernorm-1p as an
exact reparametrisation of the plain norm, --attention-backend unfused against torch's SDPA.
(--kv-channels against transformers' Llama head_dim lives in tests/interop/test_hf_interop.py.)
"""
import pytest
import torch

from megatron_lite import kernels
from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.model import GPTModel
from tests.model.test_gpt_model import GPT2, LLAMA, build

transformers = pytest.importorskip("transformers")


def _neox(rotary_pct: float):
    config = transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=32, hidden_act="gelu_new", use_parallel_residual=False, attention_dropout=0.0,
        hidden_dropout=0.0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": rotary_pct})
    return transformers.GPTNeoXForCausalLM(config).eval()


def _ours_from_neox(neox, rotary_percent: float) -> GPTModel:
    """GPT-NeoX without parallel residual is our pre-norm GPT with rope; its fused QKV is laid out per
    head as [q, k, v], which is ours with one head per query group, so the weights copy as they are."""
    model = build(dict(GPT2, vocab_size=128, seq_length=32, position_embedding_type="rope", rotary_base=500.0,
                       rotary_percent=rotary_percent, untie_embeddings_and_output_weights=True)).eval()
    theirs = {k.removeprefix("gpt_neox."): v for k, v in neox.state_dict().items()}
    names = {"embed_in": "embedding.word_embeddings", "final_layer_norm": "final_layernorm",
             "lm_head": "output_layer", "layers": "decoder.layers", "post_attention_layernorm": "pre_mlp_layernorm",
             "attention.query_key_value": "self_attention.linear_qkv", "attention.dense": "self_attention.linear_proj",
             "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
    ours = {}
    for name, tensor in theirs.items():
        for old, new in names.items():
            name = name.replace(old, new)
        ours[name] = tensor
    model.load_state_dict(ours, strict=True)
    return model


@pytest.mark.parametrize("rotary_percent", [0.25, 0.5, 1.0])
def test_rotary_percent_matches_gpt_neox(rotary_percent):
    torch.manual_seed(0)
    neox = _neox(rotary_percent)
    ours = _ours_from_neox(neox, rotary_percent)
    ids = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), neox(ids).logits, atol=1e-4, rtol=0)


def test_rotary_percent_rotates_only_the_first_channels():
    from megatron_lite.model.embedding import rotary_freqs

    config = ModelConfig(**dict(LLAMA, rotary_percent=0.5))
    assert config.rotary_dim == 8  # of a head dimension of 16
    query = torch.randn(16, 2, 4, 16)
    freqs = rotary_freqs(torch.arange(16)[None], config.rotary_dim, config.rotary_base)
    rotated = kernels.apply_rotary_pos_emb(query, freqs)
    assert torch.equal(rotated[..., 8:], query[..., 8:])
    assert not torch.allclose(rotated[1:, ..., :8], query[1:, ..., :8])  # position 0 has angle 0
    with pytest.raises(ConfigError, match=r"head dimension 16 x --rotary-percent 0.1 = 1 channels must be even"):
        ModelConfig(**dict(LLAMA, rotary_percent=0.1))


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["layernorm", "rmsnorm"])
def test_layernorm_1p_is_the_plain_norm_with_weights_minus_one(arch):
    torch.manual_seed(0)
    plain = build(arch)
    one_p = build(dict(arch, apply_layernorm_1p=True))
    with torch.no_grad():
        for name, param in plain.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)  # a trained-looking scale, not the initial ones
        one_p.load_state_dict({name: (t - 1 if name.endswith("layernorm.weight") else t)
                               for name, t in plain.state_dict().items()})
    ids = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(one_p(ids, labels=ids), plain(ids, labels=ids), atol=1e-6, rtol=1e-6)


def test_layernorm_1p_starts_at_zero_and_computes_the_same_model():
    plain, one_p = build(LLAMA, seed=3), build(dict(LLAMA, apply_layernorm_1p=True), seed=3)
    norms = {n: p for n, p in one_p.named_parameters() if n.endswith("layernorm.weight")}
    assert len(norms) == 5 and all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())
    ids = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(one_p(ids), plain(ids), atol=0, rtol=0)


def test_layernorm_1p_keeps_small_scales_exact_in_bf16():
    """(scale - 1) is stored in bf16; the 1 is added in float32, so a scale of 1 + 2^-10 is not rounded to 1."""
    from megatron_lite.model.norm import Norm

    norm = Norm(8, normalization="RMSNorm", eps=1e-6, sequence_parallel=False, params_dtype=torch.bfloat16,
                apply_layernorm_1p=True)
    with torch.no_grad():
        norm.weight.fill_(2.0 ** -10)
    x = torch.ones(2, 8)
    torch.testing.assert_close(norm(x), torch.full((2, 8), 1 + 2.0 ** -10), rtol=0, atol=1e-5)
    assert torch.tensor(1 + 2.0 ** -10, dtype=torch.bfloat16) == 1  # what a bf16 scale itself would hold


@pytest.mark.parametrize("backend", ["unfused", "local"])
def test_unfused_attention_equals_sdpa(backend, monkeypatch):
    """Same weights, same logits and gradients; the unfused path goes through the masked-softmax kernel."""
    torch.manual_seed(0)
    sdpa = build(dict(LLAMA, kv_channels=24))
    unfused = build(dict(LLAMA, kv_channels=24, attention_backend=backend))
    unfused.load_state_dict(sdpa.state_dict())
    calls = []
    softmax = kernels.scaled_upper_triang_masked_softmax
    monkeypatch.setattr(kernels, "scaled_upper_triang_masked_softmax",
                        lambda x, scale: calls.append(tuple(x.shape)) or softmax(x, scale))
    ids = torch.randint(0, 100, (3, 16))
    losses = [model(ids, labels=ids).mean() for model in (sdpa, unfused)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
    for (name, a), b in zip(sdpa.named_parameters(), unfused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert calls == [(3 * 4, 16, 16)] * 2  # [batch x heads, sq, sk], once per layer


def test_auto_flash_and_fused_are_sdpa():
    """They are the same module: only unfused/local change the path."""
    models = [build(dict(LLAMA, attention_backend=b)) for b in ("auto", "flash", "fused")]
    ids = torch.randint(0, 100, (2, 16))
    assert torch.equal(models[0](ids), models[1](ids)) and torch.equal(models[0](ids), models[2](ids))
    with pytest.raises(ConfigError, match="--attention-backend must be one of auto, flash, fused, unfused, local"):
        ModelConfig(**dict(LLAMA, attention_backend="cudnn"))


def test_kv_channels_sizes_the_projections():
    model = build(dict(LLAMA, kv_channels=24))
    params = dict(model.named_parameters())
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 24, 64)
    assert params["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 4 * 24)
    # Without --kv-channels the hidden size must split into the heads; with it, it need not.
    ModelConfig(**dict(LLAMA, hidden_size=66, kv_channels=16))
    with pytest.raises(ConfigError, match="or set the head width with --kv-channels"):
        ModelConfig(**dict(LLAMA, hidden_size=66))
