"""The sharding strategies as objects: one class per --data-parallel-sharding-strategy value, each
sharding over the data-parallel group it is built with (not a global one)."""
import pytest

from megatron_lite.config import SHARDING_STRATEGIES, ParallelConfig
from megatron_lite.distributed.sharding_strategy import STRATEGIES, sharding_strategy
from megatron_lite.process_groups.collectives import MockGroup


def test_every_flag_value_has_its_strategy():
    assert tuple(STRATEGIES) == SHARDING_STRATEGIES


# Buckets of 64 and 32 (padded) elements, on global rank 6 of the group of ranks 4-7 (its rank 2):
# ZeRO-1 shards only what the optimizer owns, ZeRO-2 keeps a 96 / 4 gradient shard plus one
# bucket-sized staging buffer (two with --overlap-grad-reduce), ZeRO-3 also a 96 / 4 parameter shard.
@pytest.mark.parametrize("name, overlap, shard_rank, parameters, gradients", [
    ("no_shard", False, 0, 96, 96),
    ("optim", False, 2, 96, 96),
    ("optim_grads", False, 2, 96, 24 + 64),
    ("optim_grads", True, 2, 96, 24 + 2 * 64),
    ("optim_grads_params", False, 2, 24, 24 + 64)])
def test_what_a_rank_stores_follows_the_group_it_is_given(name, overlap, shard_rank, parameters, gradients):
    config = ParallelConfig(data_parallel_sharding_strategy=name, overlap_grad_reduce=overlap)
    strategy = sharding_strategy(config, MockGroup(ranks=(4, 5, 6, 7), global_rank=6))
    assert strategy.name == name
    assert strategy.shard_rank == shard_rank
    assert strategy.num_shards == (1 if name == "no_shard" else 4)
    assert strategy.stored_parameter_elements([64, 32]) == parameters
    assert strategy.stored_gradient_elements([64, 32]) == (gradients, 0)
