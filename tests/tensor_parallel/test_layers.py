"""Parallel layers against torch.nn built from the gathered (full) weights.

Each rank builds the full reference layers from a shared seed, copies its shard
into the parallel layers with ``shard_tensor``, and compares outputs, input
gradients and (sharded) parameter gradients.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.collectives import count_collectives
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelConfig,
                                           VocabParallelEmbedding, gather_shards, shard_tensor)

S, B, H, F_ = 8, 2, 12, 16  # sequence, batch, hidden, ffn: all divisible by 2 and 4


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _full_reference():
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(H, F_), nn.Linear(F_, H)
    x, upstream = torch.randn(S, B, H), torch.randn(S, B, H)
    return fc1, fc2, x, upstream


def _load(layer_param, full, rank, world_size):
    with torch.no_grad():
        if getattr(layer_param, "tensor_model_parallel", False):
            full = shard_tensor(full, partition_dim=layer_param.partition_dim,
                                partition_stride=layer_param.partition_stride, rank=rank, world_size=world_size)
        layer_param.copy_(full)


def _shard(full, param, rank, world_size):
    return shard_tensor(full, partition_dim=param.partition_dim, partition_stride=param.partition_stride,
                        rank=rank, world_size=world_size)


def _column_then_row(rank, world_size, sequence_parallel):
    """The attention/MLP pattern: column-parallel, elementwise op, row-parallel."""
    group = initialize_model_parallel(world_size).tensor_model_parallel_group
    fc1, fc2, x, upstream = _full_reference()
    x_ref = x.clone().requires_grad_()
    (fc2(torch.relu(fc1(x_ref))) * upstream).sum().backward()
    y_ref = fc2(torch.relu(fc1(x)))

    column = ColumnParallelLinear(H, F_, tp_config=TensorParallelConfig(group, sequence_parallel=sequence_parallel))
    row = RowParallelLinear(F_, H, tp_config=TensorParallelConfig(group, sequence_parallel=sequence_parallel))
    for param, full in [(column.weight, fc1.weight), (column.bias, fc1.bias), (row.weight, fc2.weight),
                        (row.bias, fc2.bias)]:
        _load(param, full, rank, world_size)

    sequence_slice = (lambda t: t.chunk(world_size, dim=0)[rank]) if sequence_parallel else (lambda t: t)
    x_local = sequence_slice(x).clone().requires_grad_()
    with count_collectives() as forward_count:
        hidden, no_bias = column(x_local)
        y, _ = row(torch.relu(hidden))
    with count_collectives() as backward_count:
        (y * sequence_slice(upstream)).sum().backward()

    assert no_bias is None and hidden.shape == (S, B, F_ // world_size)
    close(y, sequence_slice(y_ref))
    close(x_local.grad, sequence_slice(x_ref.grad))
    close(column.weight.grad, _shard(fc1.weight.grad, column.weight, rank, world_size))
    close(column.bias.grad, _shard(fc1.bias.grad, column.bias, rank, world_size))
    close(row.weight.grad, _shard(fc2.weight.grad, row.weight, rank, world_size))
    assert row.bias.tensor_model_parallel is False and row.bias.sequence_parallel is sequence_parallel
    if sequence_parallel:  # each rank saw its slice of the sequence: the bias gradient is partial
        collectives.all_reduce(row.bias.grad, group)
    close(row.bias.grad, fc2.bias.grad)

    counts = {"forward": dict(forward_count.calls), "backward": dict(backward_count.calls)}
    return counts


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_then_row_match_nn_linear_and_count_collectives(run_distributed, world_size, sequence_parallel):
    counts = run_distributed(_column_then_row, world_size, args=(sequence_parallel,))[0]
    if sequence_parallel:
        expected = {("all_gather", "tensor"): 1, ("reduce_scatter", "tensor"): 1}
        assert counts == {"forward": expected, "backward": expected}
    else:
        assert counts == {"forward": {("all_reduce", "tensor"): 1}, "backward": {("all_reduce", "tensor"): 1}}


def _standalone_options(rank, world_size):
    """gather_output, input_is_parallel=False, skip_bias_add, an external weight, and stride 2."""
    group = initialize_model_parallel(world_size).tensor_model_parallel_group
    fc1, fc2, x, upstream = _full_reference()

    column = ColumnParallelLinear(H, F_, gather_output=True, tp_config=TensorParallelConfig(group))
    _load(column.weight, fc1.weight, rank, world_size)
    _load(column.bias, fc1.bias, rank, world_size)
    x_local, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, _ = column(x_local)
    close(y, fc1(x))
    (y * torch.ones_like(y)).sum().backward()
    fc1(x_ref).sum().backward()
    close(x_local.grad, x_ref.grad)
    close(column.weight.grad, _shard(fc1.weight.grad, column.weight, rank, world_size))

    row = RowParallelLinear(F_, H, input_is_parallel=False, skip_bias_add=True, tp_config=TensorParallelConfig(group))
    _load(row.weight, fc2.weight, rank, world_size)
    _load(row.bias, fc2.bias, rank, world_size)
    h = torch.randn(S, B, F_, generator=torch.Generator().manual_seed(5))
    h_local, h_ref = h.clone().requires_grad_(), h.clone().requires_grad_()
    y, bias = row(h_local)
    assert bias is row.bias
    close(y + bias, fc2(h))
    (y * upstream).sum().backward()
    (F.linear(h_ref, fc2.weight) * upstream).sum().backward()
    close(h_local.grad, h_ref.grad)

    # The tied output layer: no weight of its own, this rank's vocabulary shard passed in.
    output_layer = ColumnParallelLinear(H, F_, bias=False, skip_weight_param_allocation=True,
                                        tp_config=TensorParallelConfig(group))
    assert output_layer.weight is None
    y, _ = output_layer(x, weight=_shard(fc1.weight, column.weight, rank, world_size))
    close(y, F.linear(x, fc1.weight).chunk(world_size, dim=-1)[rank])

    # Stride 2: the fused SwiGLU fc1 holds [gate; up]; this rank's output is [gate_r; up_r].
    fused = nn.Linear(H, 2 * F_)
    column = ColumnParallelLinear(H, 2 * F_, partition_stride=2, tp_config=TensorParallelConfig(group))
    _load(column.weight, fused.weight, rank, world_size)
    _load(column.bias, fused.bias, rank, world_size)
    gate_local, up_local = column(x)[0].chunk(2, dim=-1)
    gate, up = fused(x).chunk(2, dim=-1)
    close(F.silu(gate_local) * up_local, (F.silu(gate) * up).chunk(world_size, dim=-1)[rank])
    return True


def test_standalone_options_match_nn_linear(run_distributed):
    assert run_distributed(_standalone_options, 2) == [True, True]


def _vocab_parallel_embedding(rank, world_size, sequence_parallel):
    group = initialize_model_parallel(world_size).tensor_model_parallel_group
    vocab = 16
    torch.manual_seed(0)
    reference = nn.Embedding(vocab, H)
    ids = torch.randint(0, vocab, (S, B))
    upstream = torch.randn(S, B, H)
    (reference(ids) * upstream).sum().backward()

    embedding = VocabParallelEmbedding(vocab, H,
                                       tp_config=TensorParallelConfig(group, sequence_parallel=sequence_parallel))
    _load(embedding.weight, reference.weight, rank, world_size)
    sequence_slice = (lambda t: t.chunk(world_size, dim=0)[rank]) if sequence_parallel else (lambda t: t)
    with count_collectives() as count:
        y = embedding(ids)
    (y * sequence_slice(upstream)).sum().backward()
    close(y, sequence_slice(reference(ids)))
    close(embedding.weight.grad, _shard(reference.weight.grad, embedding.weight, rank, world_size))
    return dict(count.calls)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_matches_nn_embedding(run_distributed, sequence_parallel):
    counts = run_distributed(_vocab_parallel_embedding, 4, args=(sequence_parallel,))[0]
    assert counts == {("reduce_scatter" if sequence_parallel else "all_reduce", "tensor"): 1}


def test_single_rank_layers_are_plain_linear_and_embedding():
    fc1, fc2, x, _ = _full_reference()
    column = ColumnParallelLinear(H, F_, skip_bias_add=True, tp_config=TensorParallelConfig())
    _load(column.weight, fc1.weight, 0, 1)
    _load(column.bias, fc1.bias, 0, 1)
    y, bias = column(x)
    close(y + bias, fc1(x))
    embedding = VocabParallelEmbedding(16, H, tp_config=TensorParallelConfig())
    _load(embedding.weight, fc1.weight, 0, 1)
    ids = torch.randint(0, 16, (S, B))
    close(embedding(ids), fc1.weight[ids])


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_tensor_and_gather_shards_are_inverse(stride, dim):
    full = torch.arange(8 * 16).reshape(8, 16)
    shards = [shard_tensor(full, partition_dim=dim, partition_stride=stride, rank=r, world_size=4) for r in range(4)]
    assert all(s.shape[dim] == full.shape[dim] // 4 for s in shards)
    assert torch.equal(gather_shards(shards, partition_dim=dim, partition_stride=stride), full)


def test_stride_two_shard_is_gate_and_up_halves():
    gate, up = torch.arange(8), torch.arange(100, 108)
    shard = shard_tensor(torch.cat([gate, up]), partition_dim=0, partition_stride=2, rank=1, world_size=4)
    assert shard.tolist() == [2, 3, 102, 103]


def test_parameters_are_marked_and_uninitialised_shapes():
    column = ColumnParallelLinear(H, F_, partition_stride=2, tp_config=TensorParallelConfig())
    row = RowParallelLinear(F_, H, tp_config=TensorParallelConfig(sequence_parallel=True))
    assert (column.weight.partition_dim, column.weight.partition_stride, column.bias.partition_dim) == (0, 2, 0)
    assert column.weight.tensor_model_parallel and row.weight.tensor_model_parallel
    assert row.weight.partition_dim == 1 and row.bias.sequence_parallel


def test_bad_sizes_name_the_problem():
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(H, F_, gather_output=True, tp_config=TensorParallelConfig(sequence_parallel=True))
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(F_, H, input_is_parallel=False, tp_config=TensorParallelConfig(sequence_parallel=True))
    with pytest.raises(ValueError, match="skip_weight_param_allocation"):
        ColumnParallelLinear(H, F_, skip_weight_param_allocation=True,
                             tp_config=TensorParallelConfig())(torch.zeros(1, 1, H))
    with pytest.raises(ValueError, match=r"dimension 0 of a parameter \(6\) does not split evenly over 4"):
        shard_tensor(torch.zeros(6), partition_dim=0, rank=0, world_size=4)
