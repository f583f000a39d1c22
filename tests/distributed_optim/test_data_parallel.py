"""Data parallelism and every sharding strategy reproduce the single-process run.

The toy MLP trains 10 steps with 2 micro-batches per rank and gradient clipping;
every layout must match one process on the whole global batch (losses, grad
norms and final weights within 1e-5 relative in float32).
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.process_groups import collectives
from megatron_lite.config import OptimizerConfig, ParallelConfig
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from tests.distributed import run_distributed
from tests.distributed_optim import toy
from tests.parity import assert_relative_close

LAYOUTS = [
    {},
    {"overlap_grad_reduce": True},
    {"use_distributed_optimizer": True},
    {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
    {"use_distributed_optimizer": True, "overlap_param_gather": True},
    {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True},
    {"data_parallel_sharding_strategy": "optim_grads"},
    {"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": True, "overlap_param_gather": True},
    {"data_parallel_sharding_strategy": "optim_grads_params"},
    {"data_parallel_sharding_strategy": "optim_grads_params", "overlap_grad_reduce": True,
     "overlap_param_gather": True},
]


def _train_every_layout(rank, world_size):
    parallel_state = initialize_model_parallel(1, 1)
    return [toy.train(parallel_state, 10, **layout) for layout in LAYOUTS]


@pytest.mark.parametrize("data_parallel_size", [2, 4])
def test_every_layout_matches_single_process(data_parallel_size):
    losses, norms, weights = toy.train(toy.single_process_state(), 10)
    for rank, results in enumerate(run_distributed(_train_every_layout, data_parallel_size)):
        for layout, (rank_losses, rank_norms, rank_weights) in zip(LAYOUTS, results):
            what = f"dp={data_parallel_size} rank {rank} {layout}"
            assert_relative_close(rank_losses, losses, what=f"{what} losses")
            assert_relative_close(rank_norms, norms, what=f"{what} grad norms")
            for name in weights:
                assert_relative_close(rank_weights[name], weights[name], what=f"{what} {name}")
    # Clipping was active (max norm 0.5), so the sharded norm was really exercised.
    assert max(norms) > toy.OPTIMIZER.clip_grad


class _Uneven(torch.nn.Module):
    """Parameters of 5, 7 and 11 elements, the middle one the shared embedding."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(5))
        self.embedding = torch.nn.Parameter(torch.zeros(7))
        self.embedding.shared_embedding = True
        self.b = torch.nn.Parameter(torch.zeros(11))


def _bucket_layout(rank, world_size):
    parallel_state = initialize_model_parallel(1, 1)
    group = parallel_state.data_parallel_group
    layouts = {}
    for sharded in (False, True):
        config = ParallelConfig(ddp_bucket_size=10, use_distributed_optimizer=sharded)
        model = _Uneven()
        ddp = DistributedDataParallel(model, config=config, data_parallel_group=group)
        (buffer,) = ddp.grad_buffers
        for param in model.parameters():
            start, end = buffer.param_index_map[param]
            assert param.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
            if sharded:  # the parameter itself lives in the flat buffer the all-gather writes
                assert param.data_ptr() == buffer.param_data[start:].data_ptr()
        optimizer = get_megatron_optimizer(toy.OPTIMIZER, [ddp], parallel_state=parallel_state,
                                           parallel_config=config, params_dtype=torch.float32)
        names = {id(p): n for n, p in model.named_parameters()}
        layouts[sharded] = {
            "buckets": [([names[id(p)] for p in b.params], b.offset, b.numel) for b in buffer.buckets],
            "padding": buffer.padding,
            "ranges": [(r.name, r.start, r.end) for r in optimizer.param_ranges]}
    return layouts


def test_bucket_layout_and_shards():
    results = run_distributed(_bucket_layout, 4)
    # Reverse parameter order; a bucket closes once it holds >= 10 elements; params never split.
    assert results[0][False]["buckets"] == [(["b"], 0, 11), (["embedding", "a"], 11, 12)]
    assert results[0][False]["ranges"] == [("b", 0, 11), ("embedding", 0, 7), ("a", 0, 5)]  # bucket order
    # Sharded: the shared embedding gets a bucket of its own (so first and last pipeline
    # stages shard it alike), and every bucket is padded to a multiple of dp = 4.
    assert results[0][True]["buckets"] == [(["b"], 0, 12), (["embedding"], 12, 8), (["a"], 20, 8)]
    assert results[0][True]["padding"] == 1 + 1 + 3
    ranges = [r[True]["ranges"] for r in results]
    assert ranges[0] == [("b", 0, 3), ("embedding", 0, 2), ("a", 0, 2)]
    assert ranges[3] == [("b", 9, 11), ("embedding", 6, 7)]  # its shard of "a" is all padding
    # Together the shards cover every element exactly once.
    for name, numel in [("a", 5), ("embedding", 7), ("b", 11)]:
        pieces = sorted((s, e) for rank_ranges in ranges for n, s, e in rank_ranges if n == name)
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def _count_micro_batches(ddp, parallel_state) -> list:
    """The collectives of each micro-batch's forward and backward (all but the last inside no_sync())."""
    counters = []
    batches = toy.micro_batches(0, parallel_state.data_parallel_rank, parallel_state.data_parallel_world_size)
    ddp.zero_grad_buffer()
    for i, (x, y) in enumerate(batches):
        with collectives.count_collectives() as counter:
            with ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                F.mse_loss(ddp(x), y).backward()
        counters.append(counter)
    return counters


def _count_communication(rank, world_size, sharded, overlap):
    parallel_state = initialize_model_parallel(1, 1)
    run = toy.build(parallel_state, use_distributed_optimizer=sharded, overlap_grad_reduce=overlap,
                    overlap_param_gather=sharded and overlap)
    reduce_op = "reduce_scatter" if sharded else "all_reduce"
    counts = {f"backward {i}": counter.count(reduce_op, "data")
              for i, counter in enumerate(_count_micro_batches(run.ddp, parallel_state))}
    with collectives.count_collectives() as counter:
        finalize_model_grads([run.ddp], parallel_state=parallel_state)
    counts["finalize"] = counter.count(reduce_op, "data")
    with collectives.count_collectives() as counter:
        run.optimizer.step()
    counts["step all_gather"] = counter.count("all_gather", "data")
    counts["gathers pending after step"] = sum(b.param_handle is not None for b in run.ddp.buckets)
    run.ddp(toy.micro_batches(0, parallel_state.data_parallel_rank, world_size)[0][0])  # pre-hooks wait for the gathers
    counts["gathers pending after forward"] = sum(b.param_handle is not None for b in run.ddp.buckets)
    return counts


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_reductions_only_on_last_microbatch(sharded, overlap):
    counts = run_distributed(_count_communication, 2, args=(sharded, overlap))[0]
    buckets = 2
    # Gradient accumulation inside no_sync(): no communication at all.
    assert counts["backward 0"] == 0
    # One collective per bucket, launched during the last backward when overlapping.
    assert counts["backward 1"] == (buckets if overlap else 0)
    assert counts["finalize"] == (0 if overlap else buckets)
    assert counts["step all_gather"] == (buckets if sharded else 0)
    assert counts["gathers pending after step"] == (buckets if sharded and overlap else 0)
    assert counts["gathers pending after forward"] == 0


def _zero2_communication(rank, world_size, overlap):
    parallel_state = initialize_model_parallel(1, 1)
    run = toy.build(parallel_state, data_parallel_sharding_strategy="optim_grads",
                    overlap_grad_reduce=overlap)
    (buffer,) = run.ddp.grad_buffers
    counts = [dict(counter.calls) for counter in _count_micro_batches(run.ddp, parallel_state)]
    with collectives.count_collectives() as counter:
        finalize_model_grads([run.ddp], parallel_state=parallel_state)
        run.optimizer.step()
    counts.append(dict(counter.calls))
    return {"counts": counts, "staging buffers": len(buffer.staging_pool.buffers),
            "staging numel": buffer.staging_pool.numel, "grad shard numel": buffer.grad_shard_data.numel(),
            "full gradients": buffer.grad_data, "main_grad": hasattr(run.ddp.module.fc1.weight, "main_grad"),
            "buckets": [b.numel for b in buffer.buckets]}


@pytest.mark.parametrize("overlap", [False, True])
def test_zero2_reduce_scatters_each_bucket_every_micro_batch_into_a_shard(overlap):
    result = run_distributed(_zero2_communication, 2, args=(overlap,))[0]
    buckets = result["buckets"]
    assert len(buckets) == 2
    # No full gradient buffer: each micro-batch's bucket is reduce-scattered as soon as it is complete,
    # inside no_sync() too (there is nothing to accumulate full gradients in); only that, nothing else.
    for micro_batch in result["counts"][:2]:
        assert micro_batch == {("reduce_scatter", "data"): 2}
    # Finalisation waits for what is in flight; the step gathers the updated parameters.
    assert result["counts"][2] == {("all_gather", "data"): 2, ("all_reduce", "data"): 1}  # + the grad norm
    assert result["full gradients"] is None and not result["main_grad"]
    assert result["grad shard numel"] == sum(buckets) // 2
    # One bucket-sized staging buffer, reused; with overlap one more, for the bucket in flight.
    assert result["staging numel"] == max(buckets)
    assert result["staging buffers"] == (2 if overlap else 1)


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _offload_every_strategy(rank, world_size):
    parallel_state = initialize_model_parallel(1, 1)
    results = {}
    for strategy in STRATEGIES:
        offloads = [(False, False), (True, False)] + [(True, True)] * (strategy.startswith("optim_grads"))
        for optimizer_offload, grad_offload in offloads:
            config = OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.5, optimizer_cpu_offload=optimizer_offload)
            run = toy.build(parallel_state, dtype=torch.bfloat16, optimizer_config=config,
                            data_parallel_sharding_strategy=strategy, grad_cpu_offload=grad_offload,
                            overlap_grad_reduce=True)
            losses = [toy.train_step(run, parallel_state, step)[0] for step in range(4)]
            shards = [b.grad_shard_data for b in run.ddp.grad_buffers if b.grad_shard_data is not None]
            results[(strategy, optimizer_offload, grad_offload)] = {
                "losses": losses, "main params": {m.device.type for m in run.optimizer.main_params},
                "grad shards": {s.device.type for s in shards},
                # Under --grad-cpu-offload the optimizer steps on the host shards themselves.
                "main grads alias the shards": all(m.grad_copy is None for m in run.optimizer.main_params)}
    return results


def test_cpu_offload_under_every_strategy():
    """bf16 weights: --optimizer-cpu-offload (and, for ZeRO-2/3, --grad-cpu-offload) change where the
    step runs, not what it computes."""
    for results in run_distributed(_offload_every_strategy, 2):
        for (strategy, optimizer_offload, grad_offload), result in results.items():
            assert result["losses"] == results[(strategy, False, False)]["losses"], strategy
            if optimizer_offload:
                assert result["main params"] == {"cpu"}
            if grad_offload:
                assert result["grad shards"] == {"cpu"} and result["main grads alias the shards"]


def test_gradient_buffer_dtypes():
    state = toy.single_process_state()
    for dtype, fp32_flag, expected in [(torch.bfloat16, False, torch.float32), (torch.float16, False, torch.float16),
                                       (torch.float16, True, torch.float32), (torch.float32, False, torch.float32)]:
        config = ParallelConfig(accumulate_allreduce_grads_in_fp32=fp32_flag)
        ddp = DistributedDataParallel(toy.MLP(dtype), config=config, data_parallel_group=state.data_parallel_group)
        assert ddp.module.fc1.weight.main_grad.dtype == expected, (dtype, fp32_flag)


def test_gradient_produced_twice_without_no_sync_is_an_error():
    state = toy.single_process_state()
    ddp = DistributedDataParallel(toy.MLP(), config=ParallelConfig(overlap_grad_reduce=True),
                                  data_parallel_group=state.data_parallel_group)
    x, y = toy.global_batch(0)
    F.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        F.mse_loss(ddp(x), y).backward()


def test_optimizer_needs_wrapped_chunks():
    state = toy.single_process_state()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        get_megatron_optimizer(toy.OPTIMIZER, [toy.MLP()], parallel_state=state, parallel_config=ParallelConfig(),
                               params_dtype=torch.float32)
    ddp = DistributedDataParallel(toy.MLP(), config=ParallelConfig(), data_parallel_group=None)
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        get_megatron_optimizer(toy.OPTIMIZER, [ddp], parallel_state=state,
                               parallel_config=ParallelConfig(use_distributed_optimizer=True),
                               params_dtype=torch.float32)
