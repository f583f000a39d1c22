"""PEFT under 3D parallelism trains like one process.

For LoRA, bottleneck adapters and prefix tuning (with its reparametrising MLP), a
4-layer Llama-style GPT (RMSNorm, rotary, SwiGLU's stride-2 fc1, grouped-query
attention) trains 3 steps on mock data at tp2, pp2 with interleaving (vpp2), and
tp2 x pp2 x dp2 with the distributed optimizer, sequence parallelism and overlapped
gradient reduction and parameter gathering, and dp2 under ZeRO-2 and ZeRO-3 (only the added
weights are sharded: the frozen base has no buckets). Every step's loss and every adapter gradient (reassembled from
the tensor-parallel shards and the distributed optimizer's slices) must match the
single-process run; the frozen base weights must come out bit-identical, and hold no
gradient buffer or optimizer state.
"""
import pytest
import torch

from megatron_lite.config import (Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                  PeftConfig, TrainingConfig)
from megatron_lite.tensor_parallel import gather_shards
from tests.distributed import run_distributed
from tests.parity import assert_relative_close, tensor_parallel_split

STEPS = 3
METHODS = {"lora": dict(peft="lora", lora_rank=4, lora_alpha=8.0),
           "adapter": dict(peft="adapter", adapter_dim=8),
           "prefix": dict(peft="prefix", prefix_length=3, prefix_projection_hidden_size=16)}


def _config(method: str, tp: int = 1, pp: int = 1, vpp=None, sharded: bool = False, zero=None) -> Config:
    return Config(
        model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                          seq_length=16, vocab_size=256, normalization="RMSNorm", position_embedding_type="rope",
                          swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                          hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp, use_distributed_optimizer=sharded,
                                data_parallel_sharding_strategy=zero,
                                overlap_grad_reduce=sharded, overlap_param_gather=sharded,
                                sequence_parallel=sharded and tp > 1),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS, eval_iters=1),
        optimizer=OptimizerConfig(lr=1e-2, lr_warmup_iters=1, clip_grad=1.0),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=STEPS, log_memory=False),
        peft=PeftConfig(**METHODS[method]))


def _train(rank, world_size, runs):
    """Train each run's config; per rank: losses, each step's gradients (the slices this rank owns), base check."""
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.training.data_iterators import build_data_iterators
    from megatron_lite.training.run_plan import plan_run
    from megatron_lite.training.loop import setup_model_and_optimizer, train_step

    results = []
    for run in runs:
        config = _config(**run)
        parallel = config.parallel
        ps = initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                       parallel.virtual_pipeline_model_parallel_size)
        # pretrain's own set-up and step, stepped here by hand to read every step's gradients
        chunks, optimizer, scheduler = setup_model_and_optimizer(config, ps)
        frozen = {name: p.detach().clone() for chunk in chunks for name, p in chunk.module.named_parameters()
                  if not p.requires_grad}
        iterator = build_data_iterators(config, ps, plan_run(config, ps), 0)[0]
        losses, grads = [], []
        for _ in range(STEPS):
            loss, _, _ = train_step(config, ps, chunks, optimizer, scheduler, iterator,
                                    config.training.num_microbatches(ps.data_parallel_world_size))
            losses.append(loss)
            grads.append([(r.name, r.start, r.end, r.model_grad().clone()) for r in optimizer.param_ranges])
        shapes = {r.name: tuple(r.shape) for r in optimizer.param_ranges}  # whole, also where ZeRO-3 holds a shard
        for chunk in chunks:
            chunk.finish_param_sync()
        params = {name: p for chunk in chunks for name, p in chunk.module.named_parameters()}
        base_unchanged = all(torch.equal(params[name], before) for name, before in frozen.items())
        trainable = {name for name, p in params.items() if p.requires_grad}
        buffered = {p for chunk in chunks for buffer in chunk.grad_buffers for p in buffer.param_index_map}
        results.append({
            "losses": losses, "grads": grads, "base_unchanged": base_unchanged, "frozen": len(frozen),
            "only_trainable_buffered": buffered == {params[n] for n in trainable}
                                      and {r.name for r in optimizer.param_ranges} <= trainable,
            "split": {name: (*tensor_parallel_split(p), shapes.get(name)) for name, p in params.items()},
            "tp_rank": ps.tensor_model_parallel_rank, "dp_rank": ps.data_parallel_rank})
        destroy_model_parallel(ps)
    return results


def _full_gradients(rank_results: list, step: int) -> dict:
    """Every trainable parameter's gradient at ``step``, from the slices the ranks own."""
    flat: dict = {}  # (name, tp_rank) -> flat gradient of that tensor-parallel shard
    split: dict = {}
    for result in rank_results:
        for name, start, end, grad in result["grads"][step]:
            parallel, dim, stride, shape = result["split"][name]
            split[name] = (parallel, dim, stride, shape)
            if not parallel and result["tp_rank"] != 0:
                continue  # replicated over tensor-parallel ranks: rank 0's copy is the reference
            shard = flat.setdefault((name, result["tp_rank"]), torch.full((torch.Size(shape).numel(),), float("nan")))
            shard[start:end] = grad.reshape(-1)
    full = {}
    for name, (parallel, dim, stride, shape) in split.items():
        shards = sorted((tp, g) for (n, tp), g in flat.items() if n == name)
        tensors = [g.view(shape) for _, g in shards]
        full[name] = gather_shards(tensors, partition_dim=dim, partition_stride=stride) if parallel else tensors[0]
        assert not full[name].isnan().any(), f"{name}: no rank owns part of its gradient"
    return full


# World size -> the layouts run in it (each for every method).
LAYOUTS = {2: [dict(tp=2), dict(pp=2, vpp=2), dict(zero="optim_grads"), dict(zero="optim_grads_params")],
           8: [dict(tp=2, pp=2, sharded=True)]}
_cache: dict = {}


def _results(world_size: int) -> list:
    if world_size not in _cache:
        runs = [dict(method=m, **layout) for layout in LAYOUTS.get(world_size, [{}]) for m in METHODS]
        per_rank = run_distributed(_train, world_size, args=(runs,), timeout=900)
        _cache[world_size] = {(r["method"], tuple(sorted(r.items()))): [ranks[i] for ranks in per_rank]
                              for i, r in enumerate(runs)}
    return _cache[world_size]


def _run(world_size: int, method: str, **layout) -> list:
    run = dict(method=method, **layout)
    return _results(world_size)[(method, tuple(sorted(run.items())))]


@pytest.mark.parametrize("world_size,layout", [(2, LAYOUTS[2][0]), (2, LAYOUTS[2][1]), (8, LAYOUTS[8][0]),
                                               (2, LAYOUTS[2][2]), (2, LAYOUTS[2][3])],
                         ids=["tp2", "pp2-vpp2", "tp2-pp2-dp2-distopt-sp", "dp2-zero2", "dp2-zero3"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_layout_matches_single_process(method, world_size, layout):
    (reference,) = _run(1, method)
    results = _run(world_size, method, **layout)
    what = f"{method} {layout}"
    for result in results:
        assert result["base_unchanged"] and result["frozen"] > 0, f"{what}: a frozen base weight changed"
        assert result["only_trainable_buffered"], f"{what}: a frozen weight has a gradient buffer or optimizer state"
        if result["losses"][0] is not None:
            assert_relative_close(result["losses"], reference["losses"], what=f"{what} losses")
    for step in range(STEPS):
        expected = _full_gradients([reference], step)
        actual = _full_gradients(results, step)
        assert set(actual) == set(expected), what
        for name, grad in actual.items():
            assert_relative_close(grad, expected[name], rel=1e-4, what=f"{what} step {step + 1} {name}")
    assert any(g.abs().sum() > 0 for g in _full_gradients([reference], STEPS - 1).values())
