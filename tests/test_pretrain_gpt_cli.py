"""The entry point under torchrun prints the same losses as the single-process run."""
import os
import re
import subprocess
import sys

import pytest

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "4", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
         "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-log-memory"]


def _run(nproc: int, extra: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1
                else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(launcher + ["-m", "megatron_lite.pretrain_gpt"] + FLAGS + extra, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _losses(result: subprocess.CompletedProcess) -> list[float]:
    assert result.returncode == 0, result.stderr[-3000:]
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", result.stdout)]


@pytest.fixture(scope="module")
def single_process_losses():
    losses = _losses(_run(1, []))
    assert len(losses) == 4
    return losses


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
         "--sequence-parallel"]),
], ids=["tp2", "tp2-pp2", "tp2-pp2-dp2-distopt-sp"])
def test_torchrun_matches_single_process(single_process_losses, nproc, extra):
    # The log prints 6 significant digits; the runs agree far beyond that but not bitwise.
    assert _losses(_run(nproc, extra)) == pytest.approx(single_process_losses, rel=2e-6)


def test_world_size_mismatch_fails_fast_with_the_arithmetic():
    result = _run(3, ["--tensor-model-parallel-size", "2"], timeout=120)
    assert result.returncode != 0
    assert "world size 3 is not divisible by --tensor-model-parallel-size (2)" in result.stderr + result.stdout
