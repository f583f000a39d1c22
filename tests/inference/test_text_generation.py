"""Generation with the key/value cache equals recomputing the whole sequence, token by token;
padded batches equal their prompts alone; sampling keeps to its top-k / top-p set."""
import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.inference.inference_context import StaticInferenceContext
from megatron_lite.inference.text_generation import generate, sample
from megatron_lite.model.sliding_window import layer_window
from tests.inference.models import ARCHS, VOCAB, build

PROMPTS = [[5, 17, 3], [40, 2, 9, 71, 8, 66, 12], [31], [7, 7, 50, 21, 94]]


def _recomputed(model, prompt: list[int], max_new_tokens: int, **sampling) -> list[int]:
    """The reference: no cache, the whole sequence through the model for every new token."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens]))[:, -1]
            tokens.append(int(sample(logits, **sampling)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cached_logits_equal_the_full_forward_at_every_position(arch):
    """A prompt forward, then one token per step: each step's logits are the full forward's at that position."""
    model, _ = build(arch)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    context = StaticInferenceContext(20)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :6], inference_context=context)]
        context.increment_sequence_len_offset(6)
        for position in range(6, 20):
            steps.append(model(ids[:, position:position + 1], inference_context=context))
            context.increment_sequence_len_offset(1)
    assert all(step.shape == (2, 1, VOCAB) for step in steps)  # logits of the last position only
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 5:], atol=1e-4, rtol=1e-4)
    # The cache holds this rank's key/value groups of each layer for every position, [b, groups, positions, d]
    # (a sliding-window layer only for the positions its window reaches); multi-latent attention's, the key/value
    # latent and the rotary key every head shares, each with its positions second to last too.
    config = model.config

    def cached(n):
        if config.multi_latent_attention:
            return [(2, 20, config.kv_lora_rank), (2, 1, 20, config.qk_pos_emb_head_dim)]
        positions = config.window_size[0] if layer_window(config, n) else 20
        return [(2, config.num_query_groups, positions, config.head_dim)] * 2
    assert {n: [t.shape for t in tensors] for n, tensors in context.key_value_memory_dict.items()} == {
        n: cached(n) for n in range(config.num_layers)}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(greedy=False, temperature=0.7, top_k=20, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_cached_generation_equals_recomputation(arch, sampling):
    model, _ = build(arch)
    for prompt in PROMPTS:
        cached = generate(model, [prompt], max_new_tokens=16, generator=torch.Generator().manual_seed(3), **sampling)
        recomputed = _recomputed(model, prompt, 16, generator=torch.Generator().manual_seed(3), **sampling)
        assert cached == [recomputed]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_padded_batch_equals_its_prompts_alone(arch):
    model, _ = build(arch)
    batched = generate(model, PROMPTS, max_new_tokens=12, greedy=True)
    alone = [generate(model, [prompt], max_new_tokens=12, greedy=True)[0] for prompt in PROMPTS]
    assert batched == alone
    assert len({tuple(tokens) for tokens in batched}) == len(PROMPTS)  # the prompts lead different ways


def test_each_sequence_stops_at_its_own_eod():
    model, _ = build("rope_gqa")
    free = generate(model, PROMPTS, max_new_tokens=12, greedy=True)
    eod = free[1][4]  # the fifth token of the second prompt ends it
    stopped = generate(model, PROMPTS, max_new_tokens=12, greedy=True, eod=eod)
    for tokens, stopped_tokens in zip(free, stopped):
        expected = tokens[:tokens.index(eod) + 1] if eod in tokens else tokens
        assert stopped_tokens == expected
    assert len(stopped[1]) <= 5 and stopped[1][-1] == eod
    # The batch stops once every sequence has ended: EOD at the first step ends it after one.
    assert generate(model, PROMPTS[:1], max_new_tokens=12, greedy=True, eod=free[0][0]) == [free[0][:1]]


def test_temperature_zero_is_greedy_and_every_row_draws_from_its_top_k_and_top_p_set():
    logits = torch.randn(512, 50, generator=torch.Generator().manual_seed(0))
    greedy = sample(logits, greedy=True)
    assert torch.equal(sample(logits, greedy=False, top_k=1, generator=torch.Generator()), greedy)
    assert torch.equal(sample(logits, greedy=False, top_p=1e-6, generator=torch.Generator()), greedy)
    drawn = sample(logits, greedy=False, top_k=5, generator=torch.Generator().manual_seed(1))
    assert (logits.gather(1, drawn[:, None]) >= logits.topk(5).values[:, -1:]).all()
    # top-p: the drawn token is among the most likely ones whose mass before it is under p.
    probs = torch.softmax(logits, dim=-1)
    drawn = sample(logits, greedy=False, top_p=0.5, generator=torch.Generator().manual_seed(2))
    mass_before = (probs * (probs > probs.gather(1, drawn[:, None]))).sum(dim=1)
    assert (mass_before < 0.5).all()
    assert len(set(drawn.tolist())) > 1
    model, _ = build("learned_mha")
    assert generate(model, PROMPTS, max_new_tokens=4, temperature=0) == generate(model, PROMPTS, max_new_tokens=4,
                                                                               greedy=True)


def test_a_sequence_longer_than_the_model_positions_is_an_error_naming_the_flag():
    model, _ = build("learned_mha")
    with pytest.raises(ConfigError, match="--max-new-tokens 46"):
        generate(model, [[1, 2, 3]], max_new_tokens=46, greedy=True)
    with pytest.raises(ConfigError, match="--top-p"):
        generate(model, [[1]], max_new_tokens=1, top_p=1.5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weights_stored_for_decoding_give_the_same_model(arch):
    """load_model stores CPU weight matrices column by column: same shapes, the same logits (to float
    rounding: BLAS sums in another order) and the same greedy tokens as the row-major model."""
    from megatron_lite.inference.loading import store_for_decoding

    model, _ = build(arch)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
    tokens = generate(model, PROMPTS, max_new_tokens=6, greedy=True)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    store_for_decoding(model)
    assert {name: p.shape for name, p in model.named_parameters()} == shapes
    assert all(p.t().is_contiguous() for p in model.parameters() if p.dim() == 2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    assert generate(model, PROMPTS, max_new_tokens=6, greedy=True) == tokens
