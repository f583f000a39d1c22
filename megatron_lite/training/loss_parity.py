"""The parity ladder: the same run under several parallel layouts, compared with one control.

Same flags, seed and global batch for every layout; only (tensor, pipeline, data)
parallel sizes change. Every layout must print the control's ``lm loss`` values to
float32 rounding. Dropout is switched off, because its masks legitimately depend on
the layout (pipeline stages and tensor-parallel regions draw from different streams).
This is what the equivalence tests check, packaged for users to run on their own
model and cluster before a long job.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

LOSS_PATTERN = re.compile(r"\| lm loss: ([0-9.E+-]+) \|")
DETERMINISTIC_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]


@dataclass(frozen=True)
class Layout:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """'2x2x2' = tensor x pipeline x data."""
        try:
            tp, pp, dp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"a layout is TPxPPxDP, e.g. 2x2x2; got {text!r}") from None
        return cls(tp, pp, dp)

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    def __str__(self) -> str:
        return f"{self.tensor_model_parallel_size}x{self.pipeline_model_parallel_size}x{self.data_parallel_size}"


def command(layout: Layout, flags: list[str]) -> list[str]:
    """One process runs the entry point directly; more go through torchrun on this machine."""
    launcher = [sys.executable]
    if layout.world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(layout.world_size)]
    return launcher + ["-m", "megatron_lite.pretrain_gpt", *flags, *DETERMINISTIC_FLAGS,
                       "--tensor-model-parallel-size", str(layout.tensor_model_parallel_size),
                       "--pipeline-model-parallel-size", str(layout.pipeline_model_parallel_size)]


def run_layout(layout: Layout, flags: list[str], timeout: float = 1800) -> list[float]:
    """The per-iteration lm loss the layout's run prints; raises with its output if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(command(layout, flags), capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"layout {layout} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    losses = [float(x) for x in LOSS_PATTERN.findall(result.stdout)]
    if not losses:
        # Comparing nothing with nothing would "agree": a run that logs no loss proves nothing.
        raise RuntimeError(f"layout {layout} exited 0 but printed no '| lm loss: ... |' line to compare (does "
                           f"--train-iters leave any iteration to run?):\n{result.stdout[-3000:]}")
    return losses


def max_relative_difference(control: list[float], losses: list[float]) -> float:
    """Largest relative difference per iteration; infinite when the runs logged different
    numbers of iterations or nothing at all."""
    if not control or len(control) != len(losses):
        return float("inf")
    return max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(control, losses)), default=0.0)
