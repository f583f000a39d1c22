"""The step-time model's formulas: ring collectives, compute at the sustained rate, the bubble and
tensor-parallel terms. Its estimate against measured CPU steps is wall-clock, so it is a benchmark
(``python -m bench.bench_step_time``), not a test.
"""
import dataclasses

import pytest

from megatron_lite.config import Config, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.model import flops
from megatron_lite.planner.cluster import PRESETS, Link, customise
from megatron_lite.planner.estimate import estimate
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.step_time import all_reduce_s, gather_or_scatter_s, p2p_s


def test_ring_collectives():
    link = Link(bandwidth_gbps=8.0, latency_us=10.0)  # 1 GB/s
    assert all_reduce_s(1e9, 1, link) == 0.0
    assert all_reduce_s(1e9, 4, link) == pytest.approx(6 * 10e-6 + 2 * 3 / 4)
    assert gather_or_scatter_s(1e9, 4, link) == pytest.approx(all_reduce_s(1e9, 4, link) / 2)
    assert p2p_s(1e9, Link(8.0, 10.0, p2p_bandwidth_gbps=16.0, p2p_latency_us=1.0)) == pytest.approx(0.5 + 1e-6)


def _free_network(cluster):
    fast = Link(bandwidth_gbps=1e12, latency_us=0.0)
    return dataclasses.replace(cluster, intra_node=fast, inter_node=fast, memory_bandwidth_gbs=1e12)


def test_compute_is_the_models_flops_at_the_sustained_rate():
    """Without communication: 3x the forward FLOPs (4x with full recomputation of the layers)."""
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=32000)
    cluster = _free_network(customise(PRESETS["a100-80g"], num_gpus=8))
    rate = 312e12 * 0.60
    model_flops = flops.num_floating_point_operations(model, 64, model.padded_vocab_size(1))
    base = Config(model=model, training=TrainingConfig(micro_batch_size=1, global_batch_size=64, bf16=True))
    plain = estimate(Layout(base, 8), cluster)
    assert plain.time.breakdown["compute"] == pytest.approx(model_flops / 8 / rate, rel=1e-9)
    assert plain.mfu == pytest.approx(0.60, rel=1e-3)
    full = dataclasses.replace(base, training=dataclasses.replace(base.training, recompute_granularity="full"))
    layers = 64 * 1024 * 8 * flops.transformer_layer_flops_per_token(model)
    assert estimate(Layout(full, 8), cluster).time.breakdown["compute"] == pytest.approx(
        (model_flops + layers) / 8 / rate, rel=1e-9)


def test_bubble_and_tensor_parallel_terms():
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=32000)
    cluster = customise(PRESETS["h100-80g"], num_gpus=8)
    pipelined = Config(model=model, parallel=ParallelConfig(pipeline_model_parallel_size=4),
                       training=TrainingConfig(micro_batch_size=1, global_batch_size=16, bf16=True))
    result = estimate(Layout(pipelined, 8), cluster)
    assert result.time.bubble_fraction == pytest.approx(3 / 8)  # m = 16 / 2 replicas = 8
    stage = sum(result.time.breakdown[k] for k in ("compute", "tensor_parallel", "pipeline_p2p"))
    assert result.time.breakdown["pipeline_bubble"] == pytest.approx(stage * 3 / 8)
    tensor = dataclasses.replace(pipelined, parallel=ParallelConfig(tensor_model_parallel_size=8))
    tp_time = estimate(Layout(tensor, 8), cluster).time.breakdown["tensor_parallel"]
    link = cluster.intra_node
    per_layer = 4 * all_reduce_s(1024 * 1 * 1024 * 2, 8, link)  # two forward, two backward, [s, b, h] bf16
    ends = 2 * all_reduce_s(1024 * 1024 * 2, 8, link) + 3 * all_reduce_s(1024 * 4, 8, link)
    assert tp_time == pytest.approx(16 * (8 * per_layer + ends))
