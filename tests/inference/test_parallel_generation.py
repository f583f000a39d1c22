"""Generation under tensor and pipeline parallelism gives the tokens of one process.

Each layout builds the same global model (initialisation does not depend on the layout);
every rank must return the same tokens: the last stage samples and broadcasts them.
"""
import pytest
import torch

from megatron_lite.inference.inference_context import StaticInferenceContext
from megatron_lite.inference.text_generation import generate
from tests.distributed import run_distributed
from tests.inference.models import build

PROMPTS = [[5, 17, 3], [40, 2, 9, 71, 8, 66, 12], [31]]
SAMPLED = dict(greedy=False, temperature=0.8, top_k=30, top_p=0.95)


def _generations(model, parallel_state) -> tuple:
    greedy = generate(model, PROMPTS, max_new_tokens=10, greedy=True, parallel_state=parallel_state)
    sampled = generate(model, PROMPTS, max_new_tokens=10, generator=torch.Generator().manual_seed(5),
                       parallel_state=parallel_state, **SAMPLED)
    return greedy, sampled


def _rank(rank, world_size, arch, tp, pp):
    model, parallel_state = build(arch, tp, pp)
    # Each rank caches its own layers, and its own share of the key/value groups of each.
    context = StaticInferenceContext(8)
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            model.set_input_tensor(torch.zeros(2, 1, model.config.hidden_size))
        model(torch.tensor([[1, 2]]), inference_context=context)
    cached = {n: tuple(k.shape) for n, (k, _) in context.key_value_memory_dict.items()}
    shape = (1, model.config.num_query_groups // tp, 8, model.config.head_dim)  # [b, groups, positions, d]
    expected = {int(n): shape for n in model.decoder.layers}
    assert cached == expected and len(cached) == model.config.num_layers // pp
    return _generations(model, parallel_state)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2pp2"])
@pytest.mark.parametrize("arch", ["rope_gqa", "learned_mha"])
def test_parallel_generation_equals_one_process(arch, tp, pp):
    expected = _generations(*build(arch))
    for rank_result in run_distributed(_rank, tp * pp, args=(arch, tp, pp)):
        assert rank_result == expected


MOE = dict(num_experts=4, moe_ffn_hidden_size=32)


def _moe_rank(rank, world_size, prompts_of_rank, eod):
    import dataclasses

    from megatron_lite.model.builder import build_model
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from tests.inference.models import config_of

    config = config_of("rope_gqa", **MOE)
    config.parallel = dataclasses.replace(config.parallel, expert_model_parallel_size=2)
    parallel_state = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    (model,) = build_model(config, parallel_state)
    return generate(model.eval(), prompts_of_rank[rank], max_new_tokens=8, eod=eod, greedy=True,
                    parallel_state=parallel_state)


def test_expert_parallel_ranks_with_batches_of_their_own_stop_together():
    """At ep2 the two data-parallel ranks generate different batches but share every expert layer: the rank
    whose batch ends first (its first token is EOD) must go on stepping until the other's ends, or the other
    waits forever in the experts' all-to-all. Each rank's tokens are its batch's in one process."""
    model, _ = build("rope_gqa", **MOE)
    eod = generate(model, PROMPTS[:1], max_new_tokens=1, greedy=True)[0][0]
    prompts_of_rank = [PROMPTS[:1], PROMPTS[1:]]
    expected = [generate(model, prompts, max_new_tokens=8, eod=eod, greedy=True) for prompts in prompts_of_rank]
    assert expected[0] == [[eod]] and max(len(tokens) for tokens in expected[1]) > 1
    assert run_distributed(_moe_rank, 2, args=(prompts_of_rank, eod), timeout=60) == expected


# Llama 4's layers: chunks of 5 on three layers (a rank's prefill chunks of the 12-position prompts are 3 long), the
# fourth NoPE with a temperature that grows every 4 positions.
LLAMA4 = dict(attention_chunk_size=5, no_rope_freq="4", qk_l2_norm=True, attn_temperature_tuning=True,
              attn_temperature_floor_scale=4)
# Long enough that every context-parallel rank holds real tokens of each: the prefill is split into 2 x cp chunks.
LONG_PROMPTS = [[5, 17, 3, 60, 22, 9, 41, 7, 30, 11, 2], [40, 2, 9, 71, 8], [31, 4, 18, 27, 50, 6, 13, 44]]


def _cp_rank(rank, world_size, arch, layout, model_fields):
    import dataclasses

    from megatron_lite.model.builder import build_model
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from tests.inference.models import config_of

    tp, pp, cp, ep = (layout.get(axis, 1) for axis in ("tp", "pp", "cp", "ep"))
    config = config_of(arch, tp, pp, **model_fields)
    config.parallel = dataclasses.replace(config.parallel, context_parallel_size=cp, expert_model_parallel_size=ep)
    parallel_state = initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    (model,) = build_model(config, parallel_state, whole_sequences=True)
    model.eval()
    if pp == 1:  # a split prefill: this rank runs 4 of the 8 positions and caches what the whole 8 cache
        from megatron_lite.context_parallel import ContextParallelConfig, local_positions
        split = StaticInferenceContext(12, context_parallel=ContextParallelConfig.of_layout(parallel_state))
        whole = StaticInferenceContext(12)
        positions = local_positions(8, parallel_state.context_parallel_rank, cp)[None]
        with torch.no_grad():
            ours = model(positions + 1, positions, inference_context=split)
            one_process = model(torch.arange(8)[None] + 1, torch.arange(8)[None], inference_context=whole)
        if positions[0, -1] == 7:  # the rank holding the last token returns its logits, as one process does
            torch.testing.assert_close(ours, one_process)
        assert split.splits_sequence and sorted(split.key_value_memory_dict) == sorted(whole.key_value_memory_dict)
        for layer, cached in whole.key_value_memory_dict.items():
            for ours, one_process in zip(split.key_value_memory_dict[layer], cached):
                torch.testing.assert_close(ours[..., :8, :], one_process[..., :8, :])
    greedy = generate(model, LONG_PROMPTS, max_new_tokens=8, greedy=True, parallel_state=parallel_state)
    sampled = generate(model, LONG_PROMPTS[:1], max_new_tokens=8, generator=torch.Generator().manual_seed(5),
                       parallel_state=parallel_state, **SAMPLED)
    return greedy, sampled


@pytest.mark.parametrize("arch,layout,model_fields", [
    ("rope_gqa", dict(cp=2), {}), ("rope_local_global", dict(cp=2), {}), ("mla", dict(cp=2), {}),
    ("learned_mha", dict(tp=2, cp=2), {}), ("rope_gqa", dict(pp=2, cp=2), {}), ("rope_gqa", dict(cp=2, ep=2), MOE),
    ("rope_gqa", dict(cp=2), LLAMA4)],
    ids=["cp2", "window_cp2", "mla_cp2", "tp2cp2", "pp2cp2", "moe_cp2ep2", "llama4_cp2"])
def test_context_parallel_prefill_equals_one_process(arch, layout, model_fields):
    """The prompts' prefill split over the context-parallel ranks (each caching the whole prompts' keys and
    values), decoding then on every rank: every rank's tokens are one process's, greedy and sampled, with
    padding (prompts of three lengths, padded further to 2 x cp positions), sliding windows, latent attention's
    cache, pipeline stages, experts split over the context-parallel ranks, and Llama 4's chunks (of 5, counted
    from each prompt's first real token) and NoPE layer with temperature tuning."""
    model, _ = build(arch, **model_fields)
    expected = (generate(model, LONG_PROMPTS, max_new_tokens=8, greedy=True),
                generate(model, LONG_PROMPTS[:1], max_new_tokens=8, generator=torch.Generator().manual_seed(5),
                         **SAMPLED))
    world_size = layout.get("tp", 1) * layout.get("pp", 1) * layout["cp"]
    for rank_result in run_distributed(_cp_rank, world_size, args=(arch, layout, model_fields), timeout=120):
        assert rank_result == expected
