"""Context parallelism on CPU: step time and activation memory at the same global sequence length.

A GPT whose attention dominates (sequences of 2048 positions, hidden 256) trains with the same global
batch of whole sequences four ways: one process (cp1), two data-parallel processes (cp1 x dp2, each
rank a whole sequence), and two context-parallel processes (cp2, each rank half of every sequence)
under --cp-comm-type p2p and all_gather. Each rank's steps run through the loop's own ``train_step``
(``bench/harness.py``); a step's time is the fastest of ``--steps``, scaled by the smallest
share of CPU the ranks got while runnable (``bench_step_time.uncontended_seconds``), so a shared machine
reads as an idle one. Beside each: the activation peak of a rank (the planner's counter) and the
planner's estimates for a local cluster calibrated in the same processes.

    python -m bench.bench_context_parallel [--steps 3] [--seq-length 2048]
"""
from __future__ import annotations

import argparse
import sys

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.memory import rank_memory
from bench.harness import launch_layouts
from bench.bench_step_time import uncontended_seconds

MB = 2 ** 20


def _config(seq_length: int, cp: int = 1, comm: str = "p2p") -> Config:
    model = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=seq_length, vocab_size=1024,
                        hidden_dropout=0.0, attention_dropout=0.0)
    return Config(model=model, parallel=ParallelConfig(context_parallel_size=cp, cp_comm_type=[comm]),
                  training=TrainingConfig(micro_batch_size=1, global_batch_size=2),
                  data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (the fastest counts)")
    parser.add_argument("--seq-length", type=int, default=2048)
    args = parser.parse_args(argv)
    one = {"cp1, 1 process": _config(args.seq_length)}
    two = {"cp1 x dp2": _config(args.seq_length), "cp2 p2p": _config(args.seq_length, 2, "p2p"),
           "cp2 all_gather": _config(args.seq_length, 2, "all_gather")}
    results = {}
    for world, layouts in ((1, one), (2, two)):
        per_rank = launch_layouts(world, list(layouts.values()), args.steps)
        for index, (name, config) in enumerate(layouts.items()):
            runs = [rank[index] for rank in per_rank]
            results[name] = (config, world, uncontended_seconds([run["steps"] for run in runs]),
                             max(run["activation_peak"] for run in runs))
    base_seconds = results["cp1, 1 process"][2]
    print(f"GPT, 2 layers, hidden 256, {args.seq_length} positions, global batch 2 sequences, fp32, CPU")
    print("| layout | processes | step (s) | vs 1 process | activations per rank (MB), measured | planned |")
    print("|---|---|---|---|---|---|")
    for name, (config, world, seconds, peak) in results.items():
        planned = rank_memory(Layout(config, world), device="cpu", pipeline_rank=0).activation_bytes
        print(f"| {name} | {world} | {seconds:.3f} | {seconds / base_seconds:.2f} | {peak / MB:.1f} | "
              f"{planned / MB:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
