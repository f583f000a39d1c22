"""Process groups: the rank-order rule checked on large mocked layouts, and real groups on gloo.

Rule (docs/reference.md section 4): tensor-parallel ranks vary fastest, then data-parallel,
then pipeline: rank = pipeline * (dp * tp) + data * tp + tensor.
"""
import time

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
    start = time.perf_counter()
    layout = RankLayout(world, tp, pp)
    groups = layout.all_groups()
    rank_to_group = {name: {r: g for g in family for r in g} for name, family in groups.items()}
    for rank in range(world):
        expected, coordinates = _expected_groups(world, tp, pp, rank)
        assert layout.coordinates(rank) == coordinates
        assert layout.rank(**coordinates) == rank
        for name, ranks in expected.items():
            assert rank_to_group[name].get(rank, []) == ranks, (name, rank)
    # Each family (except the embedding groups) partitions the world.
    for name in ("tensor", "data", "pipeline", "model"):
        members = sorted(r for g in groups[name] for r in g)
        assert members == list(range(world)), name
    assert len(groups["tensor"]) == world // tp and len(groups["pipeline"]) == world // pp
    assert layout.data_parallel_size == world // (tp * pp)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"checking {world} ranks took {elapsed:.2f}s; it is pure arithmetic"


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
        assert state.group_ranks == _expected_groups(64, 2, 4, rank)[0]
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
