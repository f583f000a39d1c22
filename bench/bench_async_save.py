"""How much of a checkpoint save leaves the training step under --async-save.

    python bench/bench_async_save.py [--layers 8] [--hidden 512] [--iters 8] [--save-interval 4] [--threads 2]

One process trains a GPT (vocab 8192, seq 128, micro-batch 2, fp32, mock data) for --iters iterations,
saving every --save-interval, once with blocking saves and once with --async-save. The clock runs inside the
trainer's own calls: "in the step" is the time the training thread spends in the saver (a blocking save
whole; under --async-save the copy to CPU memory, the per-iteration check, and any wait for a write still
in flight at the next save), the wait at the end of training for the last save (no training left to hide it
behind) on its own, "written" the background worker's time, and "step" each
train_step, so a step that a background write slows (both compete for the same cores) shows there.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
import torch  # noqa: E402

from bench.side_by_side import load_average, markdown_table  # noqa: E402
from megatron_lite.checkpointing import async_save  # noqa: E402
from megatron_lite.config import (CheckpointConfig, Config, LoggingConfig, ModelConfig, OptimizerConfig,  # noqa: E402
                                  TrainingConfig)
from megatron_lite.training import loop  # noqa: E402


def _config(args, save: str, asynchronous: bool) -> Config:
    return Config(
        model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                          ffn_hidden_size=4 * args.hidden, seq_length=128, max_position_embeddings=128,
                          vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=2, train_iters=args.iters),
        optimizer=OptimizerConfig(lr=1e-4),
        checkpoint=CheckpointConfig(save=save, save_interval=args.save_interval, async_save=asynchronous),
        logging=LoggingConfig(log_interval=1000, log_memory=False))


class _Times(list):
    """Seconds of each timed call (``busy`` while one runs)."""


def _timed(owner, name: str, into: list):
    """Replace ``owner.name`` by itself, timed into ``into``; returns the original. A call made inside another
    timed into the same list (``finalize`` inside ``save``) is counted once, by the outer one."""
    original = getattr(owner, name)

    def timed(*call_args, **call_kwargs):
        if getattr(into, "busy", False):
            return original(*call_args, **call_kwargs)
        into.busy, start = True, time.perf_counter()
        try:
            return original(*call_args, **call_kwargs)
        finally:
            into.busy = False
            into.append(time.perf_counter() - start)

    setattr(owner, name, timed)
    return original


def measure(args, asynchronous: bool) -> dict:
    in_step, written, steps = _Times(), _Times(), _Times()
    saver = async_save.CheckpointSaver
    timed = ((saver, "save", in_step), (saver, "maybe_finalize", in_step), (saver, "finalize", in_step),
             (async_save._Writer, "run", written), (loop, "train_step", steps))
    originals = [(owner, name, _timed(owner, name, into)) for owner, name, into in timed]
    try:
        with tempfile.TemporaryDirectory() as save:
            loop.pretrain(_config(args, save, asynchronous))
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    # The last call is the loop's wait at the end of training, which no training can hide: shown on its own.
    return {"in_step": sum(in_step[:-1]), "end_wait": in_step[-1], "written": sum(written),
            "steps": steps[1:], "saves": args.iters // args.save_interval}  # the first step warms up


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(load_average())
    rows = []
    for asynchronous in (False, True):
        result = measure(args, asynchronous)
        step = sorted(result["steps"])[len(result["steps"]) // 2]
        rows.append(["--async-save" if asynchronous else "blocking", result["saves"],
                     f"{result['in_step'] / result['saves']:.3f}", f"{result['written'] / result['saves']:.3f}",
                     f"{result['end_wait']:.3f}", f"{step:.3f}", f"{max(result['steps']):.3f}"])
    blocking = float(rows[0][2])
    print(markdown_table(["saves", "count", "in the step per save (s)", "written per save (s)",
                          "end-of-training wait (s)", "median step (s)", "slowest step (s)"], rows))
    print(f"share of a blocking save's time that leaves the step: {1 - float(rows[1][2]) / blocking:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
