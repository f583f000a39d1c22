"""Each mapping's forward and backward on real gloo ranks, against values computed by hand.

Every rank can rebuild every other rank's tensors (seeded by rank), so the
expected results of the collectives are computed locally and compared.
"""
import pytest
import torch

from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import mappings

SHAPE = (8, 2, 12)  # [s, b, h]: s and h divisible by 2 and 4


def _tensor(rank, tag, shape=SHAPE):
    generator = torch.Generator().manual_seed(1000 * tag + rank)
    return torch.randn(shape, generator=generator)


def _run(fn, x, upstream):
    """fn(x) and the gradient of sum(fn(x) * upstream) with respect to x."""
    x = x.clone().requires_grad_()
    y = fn(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad


def _check_all_mappings(rank, world_size):
    group = initialize_model_parallel(world_size).tensor_model_parallel_group
    ranks = range(world_size)
    full = [_tensor(r, 1) for r in ranks]  # rank r's full-size input
    grads = [_tensor(r, 2) for r in ranks]  # rank r's full-size upstream gradient
    last = lambda t, r: t.chunk(world_size, dim=-1)[r]  # noqa: E731
    first = lambda t, r: t.chunk(world_size, dim=0)[r]  # noqa: E731
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731

    y, g = _run(lambda x: mappings.copy_to_tensor_model_parallel_region(x, group), full[rank], grads[rank])
    close(y, full[rank])
    close(g, sum(grads))

    y, g = _run(lambda x: mappings.reduce_from_tensor_model_parallel_region(x, group), full[rank], grads[rank])
    close(y, sum(full))
    close(g, grads[rank])

    y, g = _run(lambda x: mappings.scatter_to_tensor_model_parallel_region(x, group), full[0],
                last(grads[rank], rank))
    close(y, last(full[0], rank))
    close(g, torch.cat([last(grads[r], r) for r in ranks], dim=-1))

    y, g = _run(lambda x: mappings.gather_from_tensor_model_parallel_region(x, group), last(full[0], rank),
                grads[rank])
    close(y, full[0])
    close(g, last(grads[rank], rank))

    y, g = _run(lambda x: mappings.scatter_to_sequence_parallel_region(x, group), full[0], first(grads[rank], rank))
    close(y, first(full[0], rank))
    close(g, torch.cat([first(grads[r], r) for r in ranks], dim=0))

    y, g = _run(lambda x: mappings.gather_from_sequence_parallel_region(x, group), first(full[0], rank),
                grads[rank])
    close(y, full[0])
    close(g, first(sum(grads), rank))  # reduce-scatter of the partial gradients

    y, g = _run(lambda x: mappings.gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False),
                first(full[0], rank), grads[0])
    close(y, full[0])
    close(g, first(grads[0], rank))  # every rank has the same full gradient: just keep the slice

    y, g = _run(lambda x: mappings.reduce_scatter_to_sequence_parallel_region(x, group), full[rank],
                first(grads[rank], rank))
    close(y, first(sum(full), rank))
    close(g, torch.cat([first(grads[r], r) for r in ranks], dim=0))
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_forward_and_backward(run_distributed, world_size):
    assert run_distributed(_check_all_mappings, world_size) == [True] * world_size


def test_none_group_is_identity():
    x = torch.randn(SHAPE)
    for fn in (mappings.copy_to_tensor_model_parallel_region, mappings.reduce_from_tensor_model_parallel_region,
               mappings.scatter_to_tensor_model_parallel_region, mappings.gather_from_tensor_model_parallel_region,
               mappings.scatter_to_sequence_parallel_region, mappings.gather_from_sequence_parallel_region,
               mappings.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x


def _split_indivisible_sequence(rank, world_size):
    group = initialize_model_parallel(world_size).tensor_model_parallel_group
    mappings.scatter_to_sequence_parallel_region(torch.zeros(3, 1, 4), group)


def test_indivisible_split_names_the_sizes(run_distributed):
    # In its own terms; --sequence-parallel with an indivisible --seq-length is refused by name in config
    # (tests/test_error_layers.py), before any mapping runs.
    from tests.distributed import DistributedTestError

    with pytest.raises(DistributedTestError, match="dimension 0 of size 3 into 2 equal parts"):
        run_distributed(_split_indivisible_sequence, 2)
