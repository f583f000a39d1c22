"""Print a pipeline schedule as a timeline, with its bubble fraction and activation memory.

The tables are the ones the training run executes (``schedule_table``); the
timing comes from ``timeline.simulate`` with a chunk's forward as one tick and
its backward as ``--backward-cost`` ticks, communication free.

    python tools/print_pipeline_schedule.py --pipeline-model-parallel-size 4 --num-microbatches 8
    python tools/print_pipeline_schedule.py --pipeline-model-parallel-size 4 --num-microbatches 8 \\
        --virtual-pipeline-model-parallel-size 2 --ops

Cells read F<micro-batch> / B<micro-batch> (plus the chunk letter a, b, ... when
interleaved); "--" continues a backward, "." is idle.
"""
from __future__ import annotations

import argparse
import sys

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.config import ParallelConfig
from megatron_lite.pipeline_parallel.schedule_table import build_schedule, in_flight_bound, peak_in_flight
from megatron_lite.pipeline_parallel.timeline import simulate
from megatron_lite.process_groups.failures import run_command


def timeline_rows(table, backward_cost: int) -> list[str]:
    """One text row per pipeline rank; each tick is one chunk forward."""
    v = 1 + max(op.chunk for ops in table for op in ops)
    timeline = simulate(table, forward_time=v, backward_time=v * backward_cost)
    ticks = round(timeline.makespan)

    def label(op):
        return op.kind.value + str(op.microbatch) + (chr(ord("a") + op.chunk) if v > 1 else "")

    width = 1 + max(len(label(i.op)) for intervals in timeline.intervals for i in intervals)
    rows = []
    for rank, intervals in enumerate(timeline.intervals):
        cells = ["."] * ticks
        for interval in intervals:
            start, end = round(interval.start), round(interval.end)
            cells[start:end] = [label(interval.op)] + ["--"] * (end - start - 1)
        rows.append(f"stage {rank:>2} |" + "".join(c.rjust(width) for c in cells))
    return rows


def report(pipeline_model_parallel_size: int, num_microbatches: int, virtual_size: int = 1,
           forward_only: bool = False, backward_cost: int = 2, show_ops: bool = False) -> str:
    p, m, v = pipeline_model_parallel_size, num_microbatches, virtual_size
    table = build_schedule(p, m, v, forward_only)
    name = "no pipelining" if p == 1 else ("interleaved 1F1B" if v > 1 else "1F1B")
    lines = [f"{name}: p={p} stages, m={m} micro-batches, v={v} chunks per stage"
             f"{', forward only' if forward_only else ''}", ""]
    lines += timeline_rows(table, backward_cost)
    simulated = simulate(table, forward_time=1.0, backward_time=0.0 if forward_only else float(backward_cost))
    theory = (p - 1) / (v * m)
    lines += ["", f"bubble fraction (idle / ideal time): {simulated.bubble_fraction:.4f} from the table, "
                  f"{theory:.4f} = (p-1)/{'(v*m)' if v > 1 else 'm'} in theory"]
    if not forward_only:
        lines += ["peak in-flight micro-batches per stage (activations held, in chunk units):"]
        for rank, ops in enumerate(table):
            lines.append(f"  stage {rank:>2}: {peak_in_flight(ops):>3}  (bound {in_flight_bound(p, rank, m, v)})")
    if show_ops:
        lines += ["", "ops per rank (rF/sF receive/send activations, rB/sB gradients; <micro-batch>.<chunk>):"]
        lines += [f"  stage {rank:>2}: " + " ".join(str(op) for op in ops) for rank, ops in enumerate(table)]
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_command(print_schedule, argv)


def print_schedule(argv) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--pipeline-model-parallel-size", type=int, required=True)
    parser.add_argument("--num-microbatches", type=int, required=True,
                        help="--global-batch-size / (--micro-batch-size x data-parallel size)")
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--forward-only", action="store_true", help="the evaluation schedule")
    parser.add_argument("--backward-cost", type=int, default=2, help="backward time in forwards (default 2)")
    parser.add_argument("--ops", action="store_true", help="also list every rank's ops, communication included")
    args = parser.parse_args(argv)
    # The flags' check, so a count the interleaved schedule cannot run is named by the flags that set it.
    ParallelConfig(pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                   virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                   ).check_interleaved_microbatches(args.num_microbatches)
    print(report(args.pipeline_model_parallel_size, args.num_microbatches,
                 args.virtual_pipeline_model_parallel_size, args.forward_only, args.backward_cost, args.ops))


if __name__ == "__main__":
    sys.exit(main())
