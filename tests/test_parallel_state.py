"""Process groups: the rank-order rule checked on large mocked layouts, and real groups on gloo.

Rule (docs/reference.md section 4): tensor-parallel ranks vary fastest, then context-parallel, then
data-parallel, then pipeline: rank = ((pipeline * dp + data) * cp + context) * tp + tensor. The expert
view of each pipeline stage: rank = pipeline * stage + (expert_data * ep + expert_model) * etp + expert_tensor.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.collectives import MockGroup, count_collectives
from megatron_lite.config import ConfigError
from megatron_lite.process_groups.parallel_state import (RankLayout, destroy_model_parallel, initialize_model_parallel,
                                          mock_parallel_state)
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelConfig

# (world, tp, pp): the 1,024-rank layout and others with every axis trivial or not.
LAYOUTS = [(1024, 8, 8), (1024, 1, 1), (1024, 1024, 1), (1024, 1, 1024), (512, 4, 16), (96, 2, 3), (8, 2, 2),
           (1, 1, 1)]


def _expected_groups(world, tp, pp, rank):
    """Each group of ``rank`` written straight from the rule, independently of RankLayout."""
    dp = world // (tp * pp)
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    pipeline = [q * dp * tp + d * tp + t for q in range(pp)]
    return {
        "tensor": list(range(rank - t, rank - t + tp)),
        "data": [p * dp * tp + e * tp + t for e in range(dp)],
        "pipeline": pipeline,
        "model": sorted(q * dp * tp + d * tp + s for q in range(pp) for s in range(tp)),
        # First and last stage share the tied embedding; middle stages belong to no embedding group.
        "embedding": sorted({pipeline[0], pipeline[-1]}) if p in (0, pp - 1) else [],
    }, {"tensor": t, "data": d, "pipeline": p}


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_every_rank_group_follows_the_rank_order_rule(world, tp, pp):
    layout = RankLayout(world, tp, pp)
    groups = layout.all_groups()
    rank_to_group = {name: {r: g for g in family for r in g} for name, family in groups.items()}
    for rank in range(world):
        expected, coordinates = _expected_groups(world, tp, pp, rank)
        assert {axis: layout.coordinates(rank)[axis] for axis in coordinates} == coordinates
        assert layout.rank(**coordinates) == rank
        for name, ranks in expected.items():
            assert rank_to_group[name].get(rank, []) == ranks, (name, rank)
    # Each family (except the embedding groups) partitions the world.
    for name in ("tensor", "data", "pipeline", "model"):
        members = sorted(r for g in groups[name] for r in g)
        assert members == list(range(world)), name
    assert len(groups["tensor"]) == world // tp and len(groups["pipeline"]) == world // pp
    assert layout.data_parallel_size == world // (tp * pp)


@pytest.mark.parametrize("rank", [0, 7, 8, 127, 128, 500, 1023])
def test_mock_parallel_state_of_the_1024_rank_layout(rank):
    state = mock_parallel_state(rank, 1024, tensor_model_parallel_size=8, pipeline_model_parallel_size=8)
    expected, coordinates = _expected_groups(1024, 8, 8, rank)
    assert state.group_ranks == expected
    assert (state.tensor_model_parallel_rank, state.data_parallel_rank, state.pipeline_model_parallel_rank) == (
        coordinates["tensor"], coordinates["data"], coordinates["pipeline"])
    assert (state.tensor_model_parallel_world_size, state.data_parallel_world_size,
            state.pipeline_model_parallel_world_size) == (8, 16, 8)
    assert state.is_pipeline_first_stage() == (rank < 128)
    assert state.is_pipeline_last_stage() == (rank >= 896)
    assert state.pipeline_next_rank == (rank + 128) % 1024
    assert state.pipeline_prev_rank == (rank - 128) % 1024
    assert state.is_in_embedding_group() == (rank < 128 or rank >= 896)
    assert (state.embedding_group is None) == (128 <= rank < 896)
    assert state.tensor_model_parallel_group == MockGroup(tuple(expected["tensor"]), global_rank=rank)


def test_mocked_groups_size_layers_but_refuse_to_communicate():
    state = mock_parallel_state(13, 1024, tensor_model_parallel_size=8, pipeline_model_parallel_size=8)
    group = state.tensor_model_parallel_group
    assert (collectives.world_size(group), collectives.rank(group)) == (8, 5)
    row = RowParallelLinear(64, 16, tp_config=TensorParallelConfig(group))
    assert row.weight.shape == (16, 8)
    with pytest.raises(RuntimeError, match="mocked process group"):
        row(torch.zeros(1, 1, 8))


def test_size_one_groups_are_none():
    state = mock_parallel_state(3, 8, tensor_model_parallel_size=8)
    assert state.data_parallel_group is None and state.pipeline_model_parallel_group is None
    assert state.group_ranks["pipeline"] == [3] and state.is_pipeline_first_stage() and state.is_pipeline_last_stage()
    column = ColumnParallelLinear(16, 64, tp_config=TensorParallelConfig(state.tensor_model_parallel_group))
    assert column.weight.shape == (8, 16)


def test_every_rank_creates_every_group_in_the_same_order():
    created, states = {}, {}
    for rank in (0, 5, 20, 63):  # rank 20 is on a middle pipeline stage
        calls = []
        states[rank] = state = initialize_model_parallel(2, 4, rank=rank, world_size=64,
                                          new_group=lambda ranks: calls.append(tuple(ranks)) or MockGroup(tuple(ranks)))
        created[rank] = calls
        assert state.group_ranks == _expected_groups(64, 2, 4, rank)[0]  # no context or expert family
        assert state.tensor_model_parallel_group == MockGroup(tuple(state.group_ranks["tensor"]))
    assert states[20].embedding_group is None and not states[20].is_in_embedding_group()
    assert states[63].embedding_group == MockGroup((15, 63))
    assert created[0] == created[5] == created[20] == created[63]
    all_groups = [tuple(g) for family in RankLayout(64, 2, 4).all_groups().values() for g in family if len(g) > 1]
    assert created[0] == all_groups


@pytest.mark.parametrize("world,tp,pp,fragment", [
    (12, 8, 1, "12 / (8 x 1) = 1.5"),
    (16, 3, 2, "16 / (3 x 2) = 2.66667"),
    (4, 0, 1, "must all be at least 1"),
    (4, 1, -2, "must all be at least 1"),
])
def test_bad_layouts_show_the_arithmetic_before_any_collective(world, tp, pp, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        initialize_model_parallel(tp, pp, rank=0, world_size=world, new_group=MockGroup)


def _real_groups(rank, world_size):
    state = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    sums = {}
    with count_collectives() as counter:
        for name in ("tensor", "data", "pipeline", "model", "embedding"):
            value = torch.tensor([float(rank)])
            collectives.all_reduce(value, state.groups[name])
            sums[name] = value.item()
    expected = {name: float(sum(ranks)) for name, ranks in state.group_ranks.items()}
    counts = dict(counter.calls)
    destroy_model_parallel(state)
    dist.barrier()
    return sums, expected, counts


def test_real_groups_on_eight_ranks(run_distributed):
    # tp=2 x dp=2 x pp=2: each group's all-reduce of the ranks sums exactly its members.
    for sums, expected, counts in run_distributed(_real_groups, 8):
        assert sums == expected
        assert counts == {("all_reduce", name): 1 for name in ("tensor", "data", "pipeline", "model", "embedding")}


def _expected_context_and_expert_groups(world, tp, cp, pp, ep, etp, rank):
    """The context, data x context and expert groups of ``rank``, written straight from the rule."""
    dp, stage = world // (tp * cp * pp), world // pp
    t, c, d, p = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // stage
    local = rank % stage
    et, em, ed = local % etp, (local // etp) % ep, local // (etp * ep)
    dense = lambda c_, d_: ((p * dp + d_) * cp + c_) * tp + t  # noqa: E731
    expert = lambda et_, em_, ed_: p * stage + (ed_ * ep + em_) * etp + et_  # noqa: E731
    return {
        "context": [dense(k, d) for k in range(cp)],
        "data": [dense(c, k) for k in range(dp)],
        "data_context": sorted(dense(k, e) for k in range(cp) for e in range(dp)),
        "expert_tensor": [expert(k, em, ed) for k in range(etp)],
        "expert_model": [expert(et, k, ed) for k in range(ep)],
        "expert_data": [expert(et, em, k) for k in range(stage // (etp * ep))],
    }


# (world, tp, cp, pp, ep, etp): experts split finer and coarser than tensor parallelism, with and without context.
EXPERT_CONTEXT_LAYOUTS = [(1024, 8, 2, 4, 8, 1), (1024, 2, 4, 8, 4, 2), (64, 2, 2, 2, 4, 1), (64, 1, 2, 1, 8, 4),
                          (16, 2, 2, 2, 2, 2), (8, 1, 2, 1, 2, 1)]


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", EXPERT_CONTEXT_LAYOUTS)
def test_context_and_expert_groups_follow_megatrons_order(world, tp, cp, pp, ep, etp):
    layout = RankLayout(world, tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                        expert_tensor_parallel_size=etp)
    groups = layout.all_groups()
    assert layout.data_parallel_size * tp * cp * pp == world
    assert layout.expert_data_parallel_size * etp * ep * pp == world
    for name in ("tensor", "data", "pipeline", "model", "context", "data_context", "expert_tensor", "expert_model",
                 "expert_data"):
        assert sorted(r for g in groups[name] for r in g) == list(range(world)), name
    rank_to_group = {name: {r: g for g in family for r in g} for name, family in groups.items()}
    for rank in range(0, world, max(1, world // 64)):
        for name, ranks in _expected_context_and_expert_groups(world, tp, cp, pp, ep, etp, rank).items():
            assert rank_to_group[name][rank] == ranks, (name, rank)
        where = layout.coordinates(rank)
        assert layout.rank(tensor=where["tensor"], context=where["context"], data=where["data"],
                           pipeline=where["pipeline"]) == rank
        state = mock_parallel_state(rank, world, tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                    expert_tensor_parallel_size=etp)
        assert state.context_parallel_rank == where["context"] and state.expert_model_parallel_rank == where[
            "expert_model"]
        assert collectives.world_size(state.expert_data_parallel_group) == layout.expert_data_parallel_size


def test_without_split_experts_the_expert_groups_are_the_dense_ones():
    # Experts on every rank (ep 1, etp = tp): the expert gradients are reduced with the dense ones.
    state = mock_parallel_state(5, 16, tensor_model_parallel_size=2, context_parallel_size=2)
    assert "expert_data" not in state.groups
    assert state.expert_data_parallel_group is state.data_parallel_group_with_context
    assert state.group_ranks["data_context"] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert state.expert_tensor_parallel_group is state.tensor_model_parallel_group


@pytest.mark.parametrize("sizes,fragment", [
    (dict(world_size=12, tensor_model_parallel_size=2, context_parallel_size=4), "12 / (2 x 4 x 1) = 1.5"),
    (dict(world_size=8, context_parallel_size=0), "--context-parallel-size (0)"),
    (dict(world_size=12, expert_model_parallel_size=8), "12 / 8 is not a whole number"),
    (dict(world_size=8, tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=8),
     "expert-tensor (8) x expert-model (2)"),
])
def test_bad_context_and_expert_layouts_name_the_flag(sizes, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        RankLayout(**sizes)


def _real_context_and_expert_groups(rank, world_size):
    state = initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                      expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    sums = {}
    for name in ("context", "data_context", "expert_model", "expert_data"):
        value = torch.tensor([float(rank)])
        collectives.all_reduce(value, state.groups[name])
        sums[name] = value.item()
    expected = {name: float(sum(state.group_ranks[name])) for name in sums}
    destroy_model_parallel(state)
    dist.barrier()
    return sums, expected


def test_real_context_and_expert_groups_on_eight_ranks(run_distributed):
    # tp=2 x cp=2 x dp=2; experts split over ep=2 with etp=1 (expert-data 4).
    for sums, expected in run_distributed(_real_context_and_expert_groups, 8):
        assert sums == expected


def test_counter_counts_calls_and_bytes_and_ignores_size_one_groups():
    with count_collectives() as counter:
        collectives.all_reduce(torch.zeros(4), None)
        collectives.all_gather_into_tensor(torch.zeros(4), torch.ones(4), None)
    assert dict(counter.calls) == {} and counter.total_bytes() == 0
    counter.record("all_reduce", None, torch.zeros(4, dtype=torch.float16))
    assert counter.count("all_reduce", "world") == 1 and counter.total_bytes("world") == 8


def test_reduction_device_follows_the_backend_not_the_data(monkeypatch):
    # The one rule for where a tensor to be communicated lives: the current GPU if any group is NCCL.
    backends = {"nccl_group": "nccl", "gloo_group": "gloo"}
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backends[group])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.reduction_device([None, "nccl_group"]) == torch.device("cuda", 3)
    assert collectives.reduction_device(["gloo_group", None]) == torch.device("cpu")
    assert collectives.reduction_device([None, None]) == torch.device("cpu")
