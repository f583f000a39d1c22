"""Greedy generation from an imported Hugging Face model gives transformers' own ``generate`` tokens,
prompt by prompt and as one left-padded batch, stopping at EOS as it does.

Small random GPT2LMHeadModel and LlamaForCausalLM (grouped-query attention, untied output)
are built here, saved, and imported with ``interop/hf/checkpoint``; a wider initialisation
than the default keeps a random model from repeating one token.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.interop.hf import checkpoint as hf_checkpoint  # noqa: E402
from megatron_lite.config import ParallelConfig  # noqa: E402
from megatron_lite.inference.loading import load_model, read_checkpoint_config  # noqa: E402
from megatron_lite.inference.text_generation import generate  # noqa: E402
from megatron_lite.process_groups.parallel_state import initialize_model_parallel  # noqa: E402

VOCAB, EOS, PAD = 96, 1, 0
PROMPTS = [[5, 17, 3, 60], [40, 2, 9, 71, 8, 66, 12, 33, 21], [31], [7, 7, 50, 21, 94, 2]]
MAX_NEW_TOKENS = 24


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=3, n_head=4, initializer_range=0.2,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False,
        initializer_range=0.2, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, tmp_path_factory):
    """(transformers' model, ours loaded from its import)."""
    torch.manual_seed(0)
    hf_model = {"gpt2": _gpt2, "llama": _llama}[request.param]().eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory / "hf")
    hf_checkpoint.import_hf_checkpoint(str(directory / "hf"), str(directory / "ckpt"))
    config = read_checkpoint_config(str(directory / "ckpt"), ParallelConfig())
    return hf_model, load_model(config, initialize_model_parallel(1, 1))


def _hf_generate(hf_model, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """transformers' greedy tokens after each prompt (left-padded together), cut after the first ``eos``."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (longest - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        output = hf_model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                   max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD)
    rows = output[:, longest:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in rows]


def test_greedy_generation_equals_transformers_generate(models):
    hf_model, model = models
    # An end-of-sequence token the second prompt reaches at its sixth step, so generation stops there.
    eos = _hf_generate(hf_model, PROMPTS[1:2], eos=EOS)[0][5]
    alone = [_hf_generate(hf_model, [prompt], eos)[0] for prompt in PROMPTS]
    assert len(alone[1]) <= 6 and any(len(tokens) == MAX_NEW_TOKENS for tokens in alone)
    for prompt, expected in zip(PROMPTS, alone):
        assert generate(model, [prompt], max_new_tokens=MAX_NEW_TOKENS, eod=eos, greedy=True) == [expected]
    batched = _hf_generate(hf_model, PROMPTS, eos)
    assert generate(model, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eod=eos, greedy=True) == batched
