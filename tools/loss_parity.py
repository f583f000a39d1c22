"""Run the parity ladder: one control layout and others, same flags; print how far each drifts.

    python tools/loss_parity.py --layouts 1x1x1 2x1x1 2x2x2 1x1x1x2 -- --num-layers 4 --hidden-size 256 ... --mock-data

The first layout is the control. Exits 1 if any layout's losses differ from the control's by
more than --rtol (relative), so it can gate a cluster before a long run.

Same flags, seed and global batch for every layout; only (tensor, pipeline, data, and
optionally context) parallel sizes change. Every layout must print the control's ``lm loss`` values to
float32 rounding. Dropout is switched off, because its masks legitimately depend on
the layout (pipeline stages and tensor-parallel regions draw from different streams).
This is what the equivalence tests check, packaged for users to run on their own
model and cluster before a long job.
"""
from __future__ import annotations

import argparse
import os
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.process_groups.failures import run_command

# "nan": an interval with no finite loss (every iteration skipped by the fp16 loss scaler, or a NaN run).
LOSS_PATTERN = re.compile(r"\| lm loss: ([0-9.E+-]+|nan) \|")
DETERMINISTIC_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]


@dataclass(frozen=True)
class Layout:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    context_parallel_size: int = 1

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """'2x2x2' = tensor x pipeline x data; '2x2x2x2' also x context."""
        try:
            sizes = [int(x) for x in text.lower().split("x")]
        except ValueError:
            sizes = []
        if len(sizes) not in (3, 4):
            raise ValueError(f"a layout is TPxPPxDP or TPxPPxDPxCP, e.g. 2x2x2; got {text!r}")
        return cls(*sizes)

    @property
    def world_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size
                * self.context_parallel_size)

    def __str__(self) -> str:
        text = f"{self.tensor_model_parallel_size}x{self.pipeline_model_parallel_size}x{self.data_parallel_size}"
        return text + (f"x{self.context_parallel_size}" if self.context_parallel_size > 1 else "")


def command(layout: Layout, flags: list[str]) -> list[str]:
    """One process runs the entry point directly; more go through torchrun on this machine."""
    launcher = [sys.executable]
    if layout.world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(layout.world_size)]
    return launcher + ["-m", "megatron_lite.pretrain_gpt", *flags, *DETERMINISTIC_FLAGS,
                       "--tensor-model-parallel-size", str(layout.tensor_model_parallel_size),
                       "--pipeline-model-parallel-size", str(layout.pipeline_model_parallel_size),
                       "--context-parallel-size", str(layout.context_parallel_size)]


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
    return max((_relative_difference(a, b) for a, b in zip(control, losses)), default=0.0)


def _relative_difference(control: float, loss: float) -> float:
    """An interval without a finite loss in both runs (the same skipped iterations) agrees; in one only, not."""
    if math.isnan(control) or math.isnan(loss):
        return 0.0 if math.isnan(control) and math.isnan(loss) else float("inf")
    return abs(control - loss) / max(abs(control), 1e-12)


def main(argv=None) -> int:
    return run_command(compare_layouts, argv)


def compare_layouts(argv) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--layouts", nargs="+", type=Layout.parse, required=True,
                        help="TPxPPxDP (or TPxPPxDPxCP), control first")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the training flags shared by every run")
    args = parser.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    control, *others = args.layouts
    try:
        return _compare(control, others, flags, args.rtol)
    except RuntimeError as error:  # a run failed or logged no loss: the ladder cannot pass
        print(f"loss parity FAILED: {error}", file=sys.stderr)
        return 1


def _compare(control: Layout, others: list[Layout], flags: list[str], rtol: float) -> int:
    total = len(others) + 1
    reference = _run_with_progress(control, flags, 1, total)
    print(f"{'layout':>8} {'ranks':>5} {'iterations':>10} {'max rel diff':>12}  losses")
    print(f"{str(control):>8} {control.world_size:5d} {len(reference):10d} {'control':>12}  {reference}")
    worst = 0.0
    for number, layout in enumerate(others, start=2):
        losses = _run_with_progress(layout, flags, number, total)
        difference = max_relative_difference(reference, losses)
        worst = max(worst, difference)
        print(f"{str(layout):>8} {layout.world_size:5d} {len(losses):10d} {difference:12.2e}  {losses}")
    print(f"worst relative difference {worst:.2e} ({'within' if worst <= rtol else 'ABOVE'} rtol {rtol:g})")
    return 0 if worst <= rtol else 1


def _run_with_progress(layout: Layout, flags: list[str], number: int, total: int) -> list[float]:
    """Each run can take minutes: say which is running, and how long it took (on stderr, beside the table)."""
    print(f"[{number}/{total}] running layout {layout} on {layout.world_size} process(es) ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    losses = run_layout(layout, flags)
    print(f"[{number}/{total}] layout {layout}: {len(losses)} iterations in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    return losses


if __name__ == "__main__":
    sys.exit(main())
