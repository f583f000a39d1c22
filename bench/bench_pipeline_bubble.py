"""Measured pipeline bubble of 1F1B and interleaved 1F1B on real gloo ranks, beside the theory.

Every stage's compute is a fixed sleep (forward F ms, backward 2F ms per stage,
split evenly over the v chunks of an interleaved stage), so the measurement
shows the schedule and the point-to-point traffic rather than CPU contention.
The bubble is (iteration time - ideal) / ideal, where ideal = m * (F + B) is one
stage's own work; theory is (p-1)/m for 1F1B and (p-1)/(v*m) interleaved.

    python bench/bench_pipeline_bubble.py [--forward-ms 20] [--pipeline-sizes 2 4] [--repeats 3]

All configurations run inside one world of max(pipeline sizes) processes; a
smaller pipeline runs as several data-parallel replicas side by side.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.initialize import free_local_port
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.pipeline_parallel import get_forward_backward_func
from megatron_lite.pipeline_parallel.schedule_table import build_schedule
from megatron_lite.pipeline_parallel.timeline import simulate

SEQ, BATCH, HIDDEN = 4, 1, 8


class FixedCost(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall time."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepChunk(nn.Module):
    def __init__(self, is_first: bool, forward_s: float, backward_s: float):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(HIDDEN))  # gives the first stage something to differentiate
        self.is_first, self.forward_s, self.backward_s = is_first, forward_s, backward_s
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.is_first else self.input_tensor
        return FixedCost.apply(h + self.bias, self.forward_s, self.backward_s)


def forward_step(data_iterator, chunk):
    return chunk(next(data_iterator)), lambda out: (out.mean(), {"lm loss": out.mean().detach()})


def time_iteration(ps, p, v, m, forward_s, backward_s) -> float:
    rank = ps.pipeline_model_parallel_rank
    chunks = [SleepChunk(rank == 0 and c == 0, forward_s / v, backward_s / v) for c in range(v)]
    data = [iter([torch.randn(SEQ, BATCH, HIDDEN)] * m) for _ in range(v)]
    func = get_forward_backward_func(ps)
    collectives.all_reduce(torch.zeros(1), dist.group.WORLD)  # start together
    start = time.perf_counter()
    func(forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=m, seq_length=SEQ,
         micro_batch_size=BATCH, hidden_size=HIDDEN, parallel_state=ps)
    elapsed = torch.tensor([time.perf_counter() - start])
    collectives.all_reduce(elapsed, dist.group.WORLD, op=dist.ReduceOp.MAX)  # the slowest rank ends the step
    return elapsed.item()


def worker(rank, world_size, port, args, configs):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    forward_s, backward_s = args.forward_ms / 1e3, 2 * args.forward_ms / 1e3
    rows = []
    for p, v, m in configs:
        ps = initialize_model_parallel(1, p, v if v > 1 else None)
        time_iteration(ps, p, v, m, forward_s, backward_s)  # warm-up: connections, allocator
        best = min(time_iteration(ps, p, v, m, forward_s, backward_s) for _ in range(args.repeats))
        destroy_model_parallel(ps)
        ideal = m * (forward_s + backward_s)
        predicted = simulate(build_schedule(p, m, v), forward_s, backward_s).bubble_fraction
        # What the schedule does not explain, spread over the forwards and backwards of a stage:
        # sleep wake-up and gloo message latency, paid once per op (so v times more often interleaved).
        overhead = (best - ideal * (1 + predicted)) / (2 * m * v)
        rows.append(("1F1B" if v == 1 else "interleaved", p, v, m, (p - 1) / (v * m), predicted, best / ideal - 1,
                     best * 1e3, ideal * 1e3, overhead * 1e3))
    if rank == 0:
        print(f"stage forward {args.forward_ms:g} ms, backward {2 * args.forward_ms:g} ms, best of {args.repeats}")
        print(f"{'schedule':<12}{'p':>3}{'v':>3}{'m':>4}{'theory':>9}{'table':>9}{'measured':>10}"
              f"{'step ms':>10}{'ideal ms':>10}{'overhead/op ms':>16}")
        for name, p, v, m, theory, predicted, measured, step_ms, ideal_ms, overhead_ms in rows:
            print(f"{name:<12}{p:>3}{v:>3}{m:>4}{theory:>9.3f}{predicted:>9.3f}{measured:>10.3f}"
                  f"{step_ms:>10.1f}{ideal_ms:>10.1f}{overhead_ms:>16.2f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward time of one whole stage")
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configs = []
    for p in args.pipeline_sizes:
        configs += [(p, 1, m) for m in (1, p, 2 * p, 4 * p)] + [(p, 2, m) for m in (p, 2 * p, 4 * p)]
    world_size = max(args.pipeline_sizes)
    if any(world_size % p for p in args.pipeline_sizes):
        parser.error("every --pipeline-sizes entry must divide the largest (they share one world)")
    port = free_local_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(world_size, port, args, configs), nprocs=world_size)


if __name__ == "__main__":
    main()
