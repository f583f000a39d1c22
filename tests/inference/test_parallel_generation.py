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
