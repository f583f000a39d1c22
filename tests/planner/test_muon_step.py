"""The planner's Muon step against the live optimizer: which matrices a rank holds and owns (every rank of 8-rank
layouts built in one process, as tests/planner/test_static_memory.py builds them), and the Newton-Schulz FLOPs
torch's own FLOP counter sees in a real step."""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.planner.cluster import PRESETS, customise
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.memory import peak_memory
from megatron_lite.planner.muon_step import muon_step
from megatron_lite.planner.parameters import rank_chunks
from megatron_lite.planner.static_memory import expert_data_parallel_size
from megatron_lite.planner.step_time import step_time
from megatron_lite.process_groups import collectives
from tests.planner.test_static_memory import GPT, LLAMA, MOE, WORLD, _built, _config, _first_experts_named_zero


def _muon(optimizer):
    return optimizer.optimizer.optimizers[-1]


def _plan(config, state):
    d = state.data_parallel_world_size
    return muon_step(config, state.pipeline_model_parallel_rank, data_parallel_size=d,
                     expert_data_parallel_size=expert_data_parallel_size(config, d),
                     data_parallel_rank=state.data_parallel_rank,
                     expert_data_parallel_rank=state.expert_data_parallel_rank)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
@pytest.mark.parametrize("arch,tp,pp,ep", [(GPT, 2, 2, 1), (MOE, 2, 1, 2), (LLAMA, 1, 2, 1)],
                         ids=["gpt", "moe", "llama"])
def test_the_matrices_a_rank_owns_are_the_live_optimizers(strategy, arch, tp, pp, ep):
    """The planner's matrices (shapes, tensor-parallel splits) are the live Muon's, and so is each one's owner:
    what a rank holds whole during the step (sharded strategies; nothing without sharding)."""
    config = _config(arch, tp, pp, ep=ep, strategy=strategy, bf16=True, bucket=3000, optimizer="muon")
    owned_anywhere = 0
    for rank in range(WORLD):
        state, _, _, optimizer = _built(config, rank)
        muon = _muon(optimizer)
        first = state.expert_model_parallel_rank * MOE["num_experts"] // ep
        planned = [s for chunk in rank_chunks(config, state.pipeline_model_parallel_rank) for s in chunk if s.matrix]
        assert sorted((s.name, s.matrix, s.partition_dim) for s in planned) == sorted(
            (_first_experts_named_zero(m.name, first), tuple(m.shape), m.partition_dim) for m in muon.matrices)
        live = sum(m.numel for m, owner in muon.owners.items() if owner == collectives.rank(m.data_parallel_group))
        assert _plan(config, state).owned_elements == live
        owned_anywhere += live
    assert (owned_anywhere > 0) == (strategy != "no_shard")


@pytest.mark.parametrize("split", [True, False], ids=["split-qkv", "no-split-qkv"])
def test_newton_schulz_flops_are_what_torch_counts(split):
    """Unsharded, a rank orthogonalises every matrix it holds: QKV as q, k and v and SwiGLU's fc1 as gate and up
    unless --muon-no-split-qkv; the element-wise rest counts no FLOPs."""
    config = _config(LLAMA, 1, 2, optimizer="muon")
    config = dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, muon_split_qkv=split, muon_fp32_matmul_prec="high"))
    state, _, _, optimizer = _built(config, 0)
    muon = _muon(optimizer)
    for main in muon.param_groups[0]["params"]:
        main.grad = torch.randn_like(main)
    with FlopCounterMode(display=False) as counter:
        muon.step()
    assert counter.get_total_flops() == _plan(config, state).flops > 0


def test_muon_shows_in_the_plan():
    """A 1B Llama on 8 GPUs with the distributed optimizer: Muon's step adds Newton-Schulz and the matrix moves to
    the step time, and the whole matrices a rank owns (about an eighth of them) to the memory while it runs."""
    arch = dict(LLAMA, num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                ffn_hidden_size=8192, seq_length=2048, vocab_size=32000)
    cluster = customise(PRESETS["h100-80g"], num_gpus=8)
    adam, muon = (Layout(_config(arch, strategy="optim", bf16=True, optimizer=name, global_batch_size=64), 8)
                  for name in ("adam", "muon"))
    assert step_time(muon, cluster).breakdown["optimizer"] > step_time(adam, cluster).breakdown["optimizer"]
    matrices = sum(s.elements for chunk in rank_chunks(muon.config, 0) for s in chunk if s.matrix)
    step = peak_memory(muon, device="cuda").optimizer_step_bytes
    assert 4 * matrices / 8 < step < 4 * matrices / 8 * 1.5
