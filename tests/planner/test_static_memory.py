"""Parameters, gradients and optimizer state per rank: the planner's arithmetic against real chunks.

Every rank of 8-rank layouts is built in one process (``mock_parallel_state`` groups size
the shards; nothing communicates), wrapped in DistributedDataParallel and given its
optimizer; ``optimizer.memory_report()`` must equal the estimate byte for byte.
"""
import pytest

from megatron_lite.config import Config, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_lite.distributed import DistributedDataParallel
from megatron_lite.model.builder import build_model_chunk
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.model.builder import count_parameters
from megatron_lite.planner.parameters import rank_chunks
from megatron_lite.planner.static_memory import SHARDING_STRATEGIES, static_memory
from megatron_lite.process_groups.parallel_state import mock_parallel_state

GPT = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000)
LLAMA = dict(GPT, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
WORLD = 8


def _config(arch, tp, pp, vpp=None, *, sharded=False, bf16=False, fp16=False, bucket=None, offload=False,
            optimizer="adam"):
    return Config(model=ModelConfig(**arch),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          virtual_pipeline_model_parallel_size=vpp, use_distributed_optimizer=sharded,
                                          ddp_bucket_size=bucket),
                  training=TrainingConfig(bf16=bf16, fp16=fp16),
                  optimizer=OptimizerConfig(optimizer=optimizer, optimizer_cpu_offload=offload))


def _built(config, rank):
    parallel = config.parallel
    state = mock_parallel_state(rank, WORLD, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size)
    state.virtual_pipeline_model_parallel_size = parallel.virtual_pipeline_model_parallel_size
    chunks = [build_model_chunk(config, state, pipeline_rank=state.pipeline_model_parallel_rank, virtual_rank=v)
              for v in range(parallel.virtual_pipeline_model_parallel_size or 1)]
    group = state.data_parallel_group
    wrapped = [DistributedDataParallel(c, config=parallel, data_parallel_group=group) for c in chunks]
    optimizer = get_megatron_optimizer(config.optimizer, wrapped, parallel_state=state, parallel_config=parallel,
                                       params_dtype=config.params_dtype)
    return state, chunks, optimizer


LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2), (2, 4, None)]


@pytest.mark.parametrize("arch", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("tp,pp,vpp", LAYOUTS)
def test_parameter_list_is_the_chunks_named_parameters(arch, tp, pp, vpp):
    config = _config(arch, tp, pp, vpp)
    for rank in range(0, WORLD, tp):  # tensor-parallel ranks hold the same shapes
        state, chunks, _ = _built(config, rank)
        planned = [[(s.name, s.elements) for s in chunk]
                   for chunk in rank_chunks(config, state.pipeline_model_parallel_rank)]
        assert planned == [[(n, p.numel()) for n, p in chunk.named_parameters()] for chunk in chunks]


CASES = [dict(), dict(sharded=True), dict(bf16=True), dict(bf16=True, sharded=True), dict(fp16=True, sharded=True),
         dict(sharded=True, bucket=3000), dict(bf16=True, sharded=True, bucket=5000), dict(sharded=True, offload=True),
         dict(optimizer="sgd", bf16=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "fp32")
@pytest.mark.parametrize("tp,pp,vpp", [(1, 1, None), (2, 2, None), (1, 2, 2)])
def test_every_rank_holds_what_the_planner_says(case, tp, pp, vpp):
    config = _config(GPT, tp, pp, vpp, **case)
    strategy = "optim" if case.get("sharded") else "no_shard"
    for rank in range(WORLD):
        state, _, optimizer = _built(config, rank)
        report = optimizer.memory_report()
        planned = static_memory(config, strategy, pipeline_rank=state.pipeline_model_parallel_rank,
                                data_parallel_size=state.data_parallel_world_size,
                                data_parallel_rank=state.data_parallel_rank)
        assert (planned.parameter_bytes, planned.gradient_bytes, planned.optimizer_state_bytes,
                planned.optimizer_state_on_host) == (report["parameter_bytes"], report["gradient_bytes"],
                                                     report["optimizer_state_bytes"], report["optimizer_state_on_host"])


@pytest.mark.parametrize("bf16,fp16,unsharded,sharded", [(False, False, 16, (8, 8)), (True, False, 18, (6, 12)),
                                                         (False, True, 20, (4, 16))])
def test_bytes_per_parameter_follow_the_reference_table(bf16, fp16, unsharded, sharded):
    """REFERENCE.md section 6 for a model big enough that padding is noise: 16/18/20 bytes, and
    fixed + sharded/d with the distributed optimizer."""
    arch = dict(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=16, vocab_size=50000)
    config = _config(arch, 1, 1, bf16=bf16, fp16=fp16)
    elements = count_parameters(config)
    d = 8
    for strategy, expected in [("no_shard", unsharded), ("optim", sharded[0] + sharded[1] / d)]:
        memory = static_memory(config, strategy, pipeline_rank=0, data_parallel_size=d)
        total = memory.parameter_bytes + memory.gradient_bytes + memory.optimizer_state_bytes
        assert total / elements == pytest.approx(expected, rel=1e-4)


def test_zero_stages_shard_more_and_more():
    """ZeRO-2 keeps a gradient shard plus the bucket in flight; ZeRO-3 a parameter shard plus two layers."""
    arch = dict(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=16, vocab_size=32000)
    config = _config(arch, 1, 1, bf16=True, bucket=1)  # one bucket per parameter: the largest is the embedding
    d = 64
    by = {s: static_memory(config, s, pipeline_rank=0, data_parallel_size=d) for s in SHARDING_STRATEGIES}
    psi = count_parameters(config)
    embedding, layer = 32000 * 1024, 12 * 1024 ** 2 + 13 * 1024
    assert by["no_shard"].gradient_bytes == 4 * psi
    assert by["optim"].gradient_bytes == pytest.approx(4 * psi, rel=1e-3)
    assert by["optim_grads"].optimizer_state_bytes == by["optim"].optimizer_state_bytes
    assert by["optim_grads"].gradient_bytes == pytest.approx(4 * (psi / d + embedding), rel=1e-3)
    assert by["optim_grads_params"].parameter_bytes == pytest.approx(2 * (psi / d + embedding + layer), rel=1e-3)
    assert [by[s].device_bytes for s in SHARDING_STRATEGIES] == sorted(
        (by[s].device_bytes for s in SHARDING_STRATEGIES), reverse=True)
