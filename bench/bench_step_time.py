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
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.planner import calibrate
from megatron_lite.planner.estimate import estimate
from megatron_lite.planner.layouts import Layout
from bench.harness import run_layout


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


def _calibrate_and_time(configs, timed_steps):
    # Linux shares the CPU between sessions first, then between their processes: alone in its
    # session a rank keeps its own share while the other idles in a pipeline bubble, so the
    # share seen while runnable is the share it ran at throughout (what the scaling assumes).
    os.setsid()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = configs[0].model
    calibrations = [calibrate.measure(model, torch.float32, 4)]
    runs = []
    for config in configs:
        runs.append(run_layout(config, timed_steps=timed_steps))
        calibrations.append(calibrate.measure(model, torch.float32, 4))
    dist.destroy_process_group()
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
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=0, run_id="bench_step_time")
    by_rank = elastic_launch(launch, _calibrate_and_time)(configs, timed_steps)  # torchrun's launcher, in-process
    results = [by_rank[rank] for rank in range(2)]
    typical = [calibrate.Measurements.typical(calibrations) for calibrations, _ in results]
    cluster = calibrate.local_cluster(typical[0].slowest(typical[1]), num_processes=2, dtype="fp32")
    return cluster, [[runs[i]["steps"] for _, runs in results] for i in range(len(configs))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (the fastest counts)")
    parser.add_argument("--tolerance", type=float, default=0.30)
    args = parser.parse_args(argv)
    cluster, steps = measure(list(LAYOUTS.values()), args.steps)
    print(f"local cluster: matmul {cluster.peak('fp32'):.3f} TFLOP/s at efficiency {cluster.matmul_efficiency:.2f}")
    print("| layout | estimated (s) | measured (s) | ratio |\n|---|---|---|---|")
    outside = []
    for (name, config), layout_steps in zip(LAYOUTS.items(), steps):
        estimated = estimate(Layout(config, 2), cluster).time.step_time_s
        measured = uncontended_seconds(layout_steps)
        print(f"| {name} | {estimated:.3f} | {measured:.3f} | {estimated / measured:.3f} |")
        if abs(estimated / measured - 1.0) > args.tolerance:
            outside.append(name)
    if outside:
        print(f"outside 1 +- {args.tolerance}: {', '.join(outside)}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
