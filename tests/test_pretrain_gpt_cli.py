"""The entry point under torchrun prints the same losses as the single-process run (the parity ladder)."""
import subprocess
import sys

import pytest

from tools.loss_parity import Layout, max_relative_difference, run_layout

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "4", "--eval-interval", "100", "--eval-iters", "1", "--lr", "1e-3", "--no-log-memory"]


@pytest.fixture(scope="module")
def single_process_losses():
    losses = run_layout(Layout(1, 1, 1), FLAGS, timeout=240)
    assert len(losses) == 4
    return losses


@pytest.mark.parametrize("layout, extra", [
    ("2x1x1", []),
    ("2x2x1", []),
    ("2x2x2", ["--use-distributed-optimizer", "--sequence-parallel"]),
], ids=["tp2", "tp2-pp2", "tp2-pp2-dp2-distopt-sp"])
def test_torchrun_matches_single_process(single_process_losses, layout, extra):
    losses = run_layout(Layout.parse(layout), FLAGS + extra, timeout=240)
    # The log prints 7 significant digits; the runs agree far beyond that but not bitwise.
    assert max_relative_difference(single_process_losses, losses) <= 2e-6, (single_process_losses, losses)


def test_world_size_mismatch_fails_fast_with_the_arithmetic():
    three_ranks = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "-m",
                   "megatron_lite.pretrain_gpt", *FLAGS, "--tensor-model-parallel-size", "2"]
    result = subprocess.run(three_ranks, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "world size 3 is not divisible by --tensor-model-parallel-size (2)" in result.stderr + result.stdout


def test_ladder_tool_reports_and_gates():
    """Through the real command line under torchrun: context parallelism (pipelines run above) matches."""
    result = subprocess.run([sys.executable, "tools/loss_parity.py", "--layouts", "1x1x1", "1x1x1x2", "--", *FLAGS,
                             "--train-iters", "2"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "control" in result.stdout and "within rtol" in result.stdout
    assert "[1/2] running layout 1x1x1 on 1 process(es) ..." in result.stderr  # progress while runs take minutes
    assert "[2/2] layout 1x1x1x2: 2 iterations in " in result.stderr
    assert Layout.parse("2x1x2x4").world_size == 16 and str(Layout.parse("2x2x1")) == "2x2x1"
    with pytest.raises(ValueError, match="TPxPPxDP or TPxPPxDPxCP"):
        Layout.parse("2x2")


def test_ladder_tool_fails_when_no_loss_was_logged():
    # --train-iters 0 exits cleanly without a log line: zero losses compared must not read as agreement.
    result = subprocess.run([sys.executable, "tools/loss_parity.py", "--layouts", "1x1x1", "1x1x1", "--", *FLAGS,
                             "--train-iters", "0", "--lr-decay-iters", "4"], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "loss parity FAILED" in result.stderr and "printed no '| lm loss: ... |' line" in result.stderr
    assert "within rtol" not in result.stdout
    assert max_relative_difference([], []) == float("inf")
