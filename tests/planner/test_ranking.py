"""The ranking: by step time with the pipeline bubble in it, printed with digits enough to tell
layouts apart; and fp32 planned at the rate fp32 matmuls run at."""
import pytest
import torch

from megatron_lite.config import Config, ModelConfig, TrainingConfig
from megatron_lite.planner.cluster import PRESETS, customise
from megatron_lite.planner.estimate import estimate
from megatron_lite.planner.layouts import enumerate_layouts
from megatron_lite.planner.report import format_ranking, rank, seconds_text


def _ranked(model: ModelConfig, num_gpus: int, global_batch_size: int, **training):
    config = Config(model=model, training=TrainingConfig(micro_batch_size=1, global_batch_size=global_batch_size,
                                                         **training))
    cluster = customise(PRESETS["h100-80g"], num_gpus=num_gpus)
    return rank([estimate(layout, cluster) for layout in enumerate_layouts(config, cluster)])


def test_seconds_keep_three_significant_digits():
    assert seconds_text(18.3414) == "18.341"  # the README's tables are unchanged
    assert seconds_text(0.25) == "0.250"
    assert seconds_text(3.3831e-05) == "3.38e-05"
    assert seconds_text(0.0123456) == "0.0123"
    assert seconds_text(0.0) == "0.000"


def test_a_tiny_model_prints_distinct_step_times_in_rank_order():
    """Microseconds per step: each row's time reads back to three digits, not 0.000, and rows go
    from the shortest step up."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=1000)
    ranked = _ranked(model, num_gpus=2, global_batch_size=2)
    times = [e.time.step_time_s for e in ranked]
    assert times == sorted(times)
    rows = [line.split() for line in format_ranking(ranked, top=len(ranked)).splitlines()
            if line.rstrip().endswith(("yes", "NO"))]
    printed = [float(row[10]) for row in rows]
    assert printed == pytest.approx([e.time.step_time_s for e in ranked[:len(rows)]], rel=5e-3)
    assert all(value > 0 for value in printed)


def test_the_bubble_counts_against_a_pipeline():
    """Compute-bound, two GPUs, one micro-batch: a 2-stage pipeline idles as long as it works
    (bubble 1), so it is slower than data parallelism, which halves the compute, though each of its
    stages computes half as much."""
    model = ModelConfig(num_layers=4, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000)
    ranked = _ranked(model, num_gpus=2, global_batch_size=2, bf16=True)
    data_parallel = next(i for i, e in enumerate(ranked) if e.layout.data_parallel_size == 2)
    pipeline = next(i for i, e in enumerate(ranked) if e.layout.pipeline_model_parallel_size == 2
                    and e.layout.virtual_pipeline_model_parallel_size == 1 and e.layout.num_microbatches == 1)
    assert data_parallel < pipeline
    stalled = ranked[pipeline].time
    assert stalled.bubble_fraction == pytest.approx(1.0)
    busy = stalled.step_time_s - stalled.breakdown["pipeline_bubble"] - stalled.breakdown["data_parallel"] \
        - stalled.breakdown["optimizer"]
    assert stalled.breakdown["pipeline_bubble"] == pytest.approx(busy)  # m x (one stage's work) x bubble


def test_fp32_is_planned_at_the_cuda_core_rate():
    """fp32 matmuls run on CUDA cores unless TF32 is allowed, and nothing in megatron_lite allows it
    (Megatron-LM leaves PyTorch's default too): the fp32 peak is not the TF32 tensor-core rate."""
    import megatron_lite.pretrain_gpt  # noqa: F401  (the whole training stack, kernels included)

    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    assert {name: cluster.peak("fp32") for name, cluster in PRESETS.items()} == {
        "a100-40g": 19.5, "a100-80g": 19.5, "h100-80g": 67.0, "h200-141g": 67.0}
    model = ModelConfig(num_layers=4, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000)
    fp32, bf16 = _ranked(model, 2, 8)[0], _ranked(model, 2, 8, bf16=True)[0]
    assert fp32.time.breakdown["compute"] > 10 * bf16.time.breakdown["compute"]
    assert fp32.mfu == pytest.approx(fp32.tflops_per_gpu / 67.0)
