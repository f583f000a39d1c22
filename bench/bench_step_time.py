"""The planner's step-time estimate against measured CPU steps on this machine.

Real training steps (the loop's own ``train_step``, through ``bench/harness.py``) of small
layouts run on 2 gloo ranks, and ``--cluster local`` is calibrated in the same processes before and
after each layout. On a shared machine wall-clock time is stretched by however long the ranks wait for
a CPU: calibration times compute in CPU time, and each measured step is scaled by the smallest share of
CPU the ranks got while runnable during it (Linux's schedstat), i.e. the step as it would run with the
cores to itself. The fastest of ``--steps`` steps counts; on an idle machine the share is 1 and this is
the plain wall-clock time.

    python -m bench.bench_step_time [--steps 3] [--tolerance 0.30]

Prints, per layout, the estimate, the measurement and their ratio; exits 1 if a ratio falls outside
1 +- tolerance. Measured on an idle 2-core machine: every layout within 30%.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.planner import calibrate
from megatron_lite.planner.estimate import estimate
from megatron_lite.planner.layouts import Layout
# Run as a module (python -m bench.bench_step_time) or imported by run_all.py: the repository root is on the path.
from bench.harness import run_layout
from bench.side_by_side import markdown_table


def _config(tp=1, pp=1, vpp=None):
    # Big enough that matmuls dominate a step (about 40 GFLOP per rank), small enough for 2 cores.
    model = ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=128, vocab_size=1024,
                        hidden_dropout=0.0, attention_dropout=0.0)
    return Config(model=model, parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                       virtual_pipeline_model_parallel_size=vpp),
                  training=TrainingConfig(micro_batch_size=4, global_batch_size=8),
                  data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))


LAYOUTS = {"tp2": _config(tp=2), "pp2-1f1b": _config(pp=2), "pp2-interleaved": _config(pp=2, vpp=2),
           "dp2": _config()}


def _calibrate_and_time(rank, world_size, configs, timed_steps):
    # Linux shares the CPU between sessions first, then between their processes: alone in its
    # session a rank keeps its own share while the other idles in a pipeline bubble, so the
    # share seen while runnable is the share it ran at throughout (what the scaling assumes).
    os.setsid()
    model = configs[0].model
    calibrations = [calibrate.measure(model, torch.float32, 4)]
    runs = []
    for config in configs:
        runs.append(run_layout(config, timed_steps=timed_steps))
        calibrations.append(calibrate.measure(model, torch.float32, 4))
    return calibrations, runs


def uncontended_seconds(rank_steps: list) -> float:
    """Fastest step, each scaled by the smallest CPU share any rank got while runnable during it."""
    scaled = []
    for step in zip(*rank_steps):
        wall = max(s[0] for s in step)
        scaled.append(wall * min(cpu / (cpu + waiting) for _, cpu, waiting in step))
    return min(scaled)


def measure(configs: list, timed_steps: int) -> tuple:
    """(the local cluster as calibrated around the runs, each config's steps on each rank)."""
    results = calibrate.run_on_local_processes(_calibrate_and_time, 2, configs, timed_steps)
    typical = [calibrate.Measurements.typical(calibrations) for calibrations, _ in results]
    cluster = calibrate.local_cluster(typical[0].slowest(typical[1]), num_processes=2, dtype="fp32")
    return cluster, [[runs[i]["steps"] for _, runs in results] for i in range(len(configs))]


def compare(timed_steps: int) -> tuple:
    """(the calibrated local cluster, [(layout, estimated seconds, measured seconds)])."""
    cluster, steps = measure(list(LAYOUTS.values()), timed_steps)
    return cluster, [(name, estimate(Layout(config, 2), cluster).time.step_time_s, uncontended_seconds(layout_steps))
                     for (name, config), layout_steps in zip(LAYOUTS.items(), steps)]


def outside(rows: list, tolerance: float) -> list:
    """The layouts whose estimate is off by more than ``tolerance`` of the measurement."""
    return [name for name, estimated, measured in rows if abs(estimated / measured - 1.0) > tolerance]


def table(cluster, rows: list) -> str:
    return (f"local cluster: matmul {cluster.peak('fp32'):.3f} TFLOP/s at efficiency {cluster.matmul_efficiency:.2f}\n"
            + markdown_table(["layout", "estimated (s)", "measured (s)", "estimated / measured"],
                             [[name, f"{estimated:.3f}", f"{measured:.3f}", f"{estimated / measured:.3f}"]
                              for name, estimated, measured in rows]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (the fastest counts)")
    parser.add_argument("--tolerance", type=float, default=0.30)
    args = parser.parse_args(argv)
    cluster, rows = compare(args.steps)
    print(table(cluster, rows))
    off = outside(rows, args.tolerance)
    if off:
        print(f"outside 1 +- {args.tolerance}: {', '.join(off)}")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
