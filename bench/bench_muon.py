"""The optimizer step alone: Muon against AdamW on bench_training's GPT-2 and Llama shapes, one process, fp32.

Gradients are drawn once; each round times ``optimizer.step()`` (clipping at 1.0, the update, the copy back) of
our own optimizer, built by the loop's set-up as training builds it. For Muon the Newton-Schulz iterations are
timed apart (their share of its step). Muon runs fp32 iterations (--muon-fp32-matmul-prec high) by default, and
its default bf16 ones (medium) on request (``--kinds "muon fp32" "muon bf16"``), both with Megatron-LM's defaults
otherwise.
The bf16 row is for CPUs with native bf16 (AVX512-BF16 or AMX): on an AVX2-only CPU torch emulates bf16 matmuls,
and a 512 x 2048 Gram-and-update iteration takes about 10 s instead of 0.08 s in fp32.

    python bench/bench_muon.py [--shapes gpt2 llama] [--kinds "muon fp32" "muon bf16"] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_training import hf_config  # noqa: E402
from bench.side_by_side import markdown_table  # noqa: E402

KINDS = {"adam": {"optimizer": "adam"}, "muon bf16": {"optimizer": "muon"},
         "muon fp32": {"optimizer": "muon", "muon_fp32_matmul_prec": "high"}}


def build(shape: str, optimizer: dict):
    from megatron_lite.interop.hf.weights import model_config_from_hf
    from megatron_lite.config import Config, DataConfig, LoggingConfig, OptimizerConfig, TrainingConfig
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.training.loop import setup_model_and_optimizer

    config = Config(model=dataclasses.replace(model_config_from_hf(hf_config(shape).to_dict()), seq_length=256),
                    training=TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=1),
                    optimizer=OptimizerConfig(lr_decay_style="constant", **optimizer),
                    data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))
    ps = initialize_model_parallel(1, 1)
    _, opt, _ = setup_model_and_optimizer(config, ps)
    generator = torch.Generator().manual_seed(0)
    for r in opt.param_ranges:
        r.model_grad().copy_(torch.randn(r.model_grad().shape, generator=generator))
    return opt, ps


def time_steps(shape: str, optimizer: dict, rounds: int) -> tuple:
    from megatron_lite.optimizer import muon
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel

    opt, ps = build(shape, optimizer)
    ns_time, newton_schulz = [0.0], muon.newton_schulz

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = newton_schulz(*args, **kwargs)
        ns_time[0] += time.perf_counter() - start
        return result

    steps, shares = [], []
    with mock.patch.object(muon, "newton_schulz", timed):
        for _ in range(rounds + 1):  # the first round warms up
            grads = [r.model_grad().clone() for r in opt.param_ranges]
            ns_time[0] = 0.0
            start = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - start)
            shares.append(ns_time[0] / steps[-1])
            for r, grad in zip(opt.param_ranges, grads):  # the step consumed them (zero_grad, clipping)
                r.model_grad().copy_(grad)
    destroy_model_parallel(ps)
    return statistics.median(steps[1:]), statistics.median(shares[1:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--kinds", nargs="+", choices=[k for k in KINDS if k != "adam"], default=["muon fp32"],
                        help="the Muon rows, each timed beside AdamW's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for shape in args.shapes:
        adam, _ = time_steps(shape, KINDS["adam"], args.rounds)
        rows.append([shape, "adam", f"{adam * 1e3:.1f}", "1.00", "-"])
        for kind in args.kinds:
            step, share = time_steps(shape, KINDS[kind], args.rounds)
            rows.append([shape, kind, f"{step * 1e3:.1f}", f"{step / adam:.2f}",
                         f"{share:.0%}"])
    print(markdown_table(["shape", "optimizer", "step ms (median)", "x AdamW", "Newton-Schulz share"], rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
