"""The log line keeps Megatron-LM's exact format; FLOPs follow the published formula."""
import re

import pytest

from megatron_lite.config import ModelConfig
from megatron_lite.model import flops
from megatron_lite.training import metrics


def test_iteration_log_line_matches_megatron():
    line = metrics.format_iteration_log(
        iteration=10, train_iters=100, consumed_samples=640, elapsed_ms=123.44, tflops_per_gpu=1.23,
        learning_rate=3e-4, global_batch_size=64, lm_loss=6.123456, loss_scale=1.0, grad_norm=1.2344,
        skipped_iterations=0, nan_iterations=0)
    assert line == (" iteration       10/     100 | consumed samples:          640 | elapsed time per iteration "
                    "(ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 1.23 | learning rate: 3.000000E-04 | global "
                    "batch size:    64 | lm loss: 6.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of "
                    "skipped iterations:   0 | number of nan iterations:   0 |")
    # What users' parsers do with it:
    assert float(re.search(r"lm loss: ([0-9.E+-]+)", line).group(1)) == pytest.approx(6.123456)


def test_validation_line():
    line = metrics.format_validation_log(iteration=100, lm_loss=5.9)
    assert line.startswith(" validation loss at iteration 100 | lm loss value: 5.900000E+00 | lm loss PPL: 3.6")


def test_flops_match_megatron_formula_for_gpt():
    config = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                         vocab_size=50257)
    B, s, layers, h, V = 8, 2048, 24, 2048, 50304
    expected = 72 * B * s * layers * h * h * (1 + s / (6 * h) + V / (12 * layers * h))
    assert flops.num_floating_point_operations(config, B, V) == pytest.approx(expected, rel=1e-12)


def test_mfu_above_100_percent_warns():
    with pytest.warns(UserWarning, match="above 100%"):
        assert metrics.model_flops_utilization(500.0, 312.0) > 1
    assert metrics.model_flops_utilization(10.0, None) is None


@pytest.mark.parametrize("tflops, text", [(152.14, "152.1"), (1.234, "1.23"), (0.000123456, "0.000123")])
def test_throughput_keeps_enough_digits_for_a_cpu(tflops, text):
    line = metrics.format_iteration_log(
        iteration=1, train_iters=1, consumed_samples=1, elapsed_ms=1.0, tflops_per_gpu=tflops, learning_rate=1e-4,
        global_batch_size=1, lm_loss=1.0, loss_scale=1.0, grad_norm=None, skipped_iterations=0, nan_iterations=0)
    assert f"throughput per GPU (TFLOP/s/GPU): {text} |" in line


def test_an_interval_without_an_update_has_no_loss_field():
    """Megatron-LM's line for an interval whose iterations were all skipped (fp16 overflows)."""
    line = metrics.format_iteration_log(
        iteration=2, train_iters=4, consumed_samples=4, elapsed_ms=1.0, tflops_per_gpu=None, learning_rate=1e-4,
        global_batch_size=2, lm_loss=None, loss_scale=2.0 ** 31, grad_norm=None, skipped_iterations=2,
        nan_iterations=0)
    assert "lm loss" not in line and " global batch size:     2 | loss scale: 2147483648.0 |" in line
