"""Single-process checks of the GPT model: shapes, causality, learning, init."""
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig

GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100,
            hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT2, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96)


def build(arch: dict, seed: int = 1) -> GPTModel:
    config = ModelConfig(**arch)
    state = initialize_model_parallel(1, 1)
    model = GPTModel(config, TensorParallelConfig())
    initialize_weights([model], config, state, seed=seed)
    return model


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_shapes(arch):
    model = build(arch)
    ids = torch.randint(0, 100, (3, 16))
    assert model(ids).shape == (3, 16, 100)  # padding rows of the vocabulary are not returned
    assert model(ids, labels=ids).shape == (3, 16)
    names = dict(model.named_parameters())
    qkv_rows = (4 + 2 * (arch.get("num_query_groups") or 4)) * 16
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows, 64)
    fc1_rows = 2 * 96 if arch.get("swiglu") else 256
    assert names["decoder.layers.1.mlp.linear_fc1.weight"].shape == (fc1_rows, 64)
    assert ("output_layer.weight" in names) == bool(arch.get("untie_embeddings_and_output_weights"))


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_causal(arch):
    """Logits at position t do not depend on tokens after t."""
    model = build(arch).eval()
    ids = torch.randint(0, 100, (2, 16))
    changed = ids.clone()
    changed[:, 9:] = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_tiny_batch_overfits(arch):
    torch.manual_seed(0)
    model = build(arch)
    ids = torch.randint(0, 100, (2, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(60):
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 4.0 and loss.item() < 0.1, (first, loss.item())


def test_init_is_deterministic_and_scaled():
    a, b, c = build(GPT2, seed=5), build(GPT2, seed=5), build(GPT2, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name
    params = dict(a.named_parameters())
    proj = params["decoder.layers.0.self_attention.linear_proj.weight"].std().item()
    qkv = params["decoder.layers.0.self_attention.linear_qkv.weight"].std().item()
    assert abs(qkv - 0.02) < 0.002 and abs(proj - 0.02 / 2.0) < 0.002  # 1/sqrt(2 * layers), 2 layers
    assert torch.equal(params["decoder.layers.0.input_layernorm.weight"], torch.ones(64))


def test_tied_output_uses_embedding():
    model = build(GPT2)
    ids = torch.randint(0, 100, (1, 16))
    model(ids, labels=ids).sum().backward()
    assert "output_layer.weight" not in dict(model.named_parameters())
    assert model.embedding.word_embeddings.weight.grad.abs().sum() > 0


def test_loss_ignores_vocabulary_padding():
    """tp changes how many padding rows the vocabulary gets; the loss must not see them."""
    ids = torch.randint(0, 100, (2, 17))
    losses = []
    for divisible_by in (128, 512):
        model = build(dict(GPT2, make_vocab_size_divisible_by=divisible_by))
        losses.append(model(ids[:, :-1], labels=ids[:, 1:]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
