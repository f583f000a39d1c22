"""Per-step time, communication and memory of data parallelism, with and without the
distributed optimizer.

For each data-parallel size a world of that many gloo processes trains a small GPT
(fixed micro-batch per rank, so the global batch grows with dp) and reports, per rank
and per step:

- step time (median over the timed steps; the slowest rank's time counts);
- payload: bytes handed to data-parallel collectives (``count_collectives``);
- ring bytes: what a ring algorithm sends per rank, 2(d-1)/d x size for an all-reduce,
  (d-1)/d x size for a reduce-scatter, (d-1) x shard for an all-gather. ZeRO's claim
  is that sharding keeps this at 2 x gradient bytes: reduce-scatter + all-gather cost
  what one all-reduce does;
- memory: parameter + gradient and optimizer-state bytes from ``optimizer.memory_report()``.

    python bench/bench_data_parallel.py [--data-parallel-sizes 1 2 4] [--steps 5] [--bf16]

On a machine with fewer cores than processes the ranks share cores, so step times
grow with dp for reasons unrelated to communication; the byte columns are exact.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lite.process_groups import collectives
from megatron_lite.config import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel

MODEL = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024,
                    hidden_dropout=0.0, attention_dropout=0.0)
MICRO_BATCH, MICRO_BATCHES = 2, 2


def ring_bytes(op: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for a collective whose local tensor is ``payload`` bytes."""
    d = group_size
    return {"all_reduce": 2 * (d - 1) / d * payload, "reduce_scatter": (d - 1) / d * payload,
            "all_gather": (d - 1) * payload}.get(op, 0.0)


def train_step(ddp, optimizer, parallel_state, generator):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    for i in range(MICRO_BATCHES):
        tokens = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH, MODEL.seq_length + 1), generator=generator)
        with ddp.no_sync() if i < MICRO_BATCHES - 1 else contextlib.nullcontext():
            loss = ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean() / MICRO_BATCHES
            optimizer.scale_loss(loss).backward()
    finalize_model_grads([ddp], parallel_state=parallel_state)
    optimizer.step()


def run(parallel_state, sharded: bool, args) -> dict:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = ParallelConfig(use_distributed_optimizer=sharded, overlap_grad_reduce=True,
                            overlap_param_gather=sharded, ddp_bucket_size=args.bucket_size)
    model = GPTModel(MODEL, parallel_state, params_dtype=dtype)
    initialize_weights([model], MODEL, parallel_state, seed=1234)
    ddp = DistributedDataParallel(model, config=config, data_parallel_group=parallel_state.data_parallel_group)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4), [ddp], parallel_state=parallel_state,
                                       parallel_config=config, params_dtype=dtype)
    generator = torch.Generator().manual_seed(parallel_state.data_parallel_rank)
    train_step(ddp, optimizer, parallel_state, generator)  # warm-up: allocator, gloo connections
    dp = parallel_state.data_parallel_world_size
    times, payload = [], {}
    for _ in range(args.steps):
        collectives.all_reduce(torch.zeros(1), parallel_state.data_parallel_group)  # start together
        start = time.perf_counter()
        with collectives.count_collectives() as counter:
            train_step(ddp, optimizer, parallel_state, generator)
            ddp.finish_param_sync()  # an overlapped gather belongs to this step
        elapsed = torch.tensor([time.perf_counter() - start])
        collectives.all_reduce(elapsed, parallel_state.data_parallel_group, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        for (op, group), size in counter.bytes.items():
            if group == "data":
                payload[op] = payload.get(op, 0) + size
    report = optimizer.memory_report()
    return {"step_ms": statistics.median(times) * 1e3,
            "payload": sum(payload.values()) / args.steps,
            "ring": sum(ring_bytes(op, b, dp) for op, b in payload.items()) / args.steps,
            "grad_bytes": report["gradient_bytes"],
            "model_bytes": report["parameter_bytes"] + report["gradient_bytes"],
            "optimizer_bytes": report["optimizer_state_bytes"],
            "params": sum(p.numel() for p in model.parameters())}


def worker(rank, world_size, port, args, queue):
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state = initialize_model_parallel(1, 1, rank=rank, world_size=world_size)
    rows = [run(parallel_state, sharded, args) for sharded in (False, True)]
    if rank == 0:
        queue.put(rows)
    destroy_model_parallel(parallel_state)
    if world_size > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-parallel-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size in elements")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights, fp32 gradients (default fp32)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    results = {}
    for dp in args.data_parallel_sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = context.SimpleQueue()
        mp.start_processes(worker, args=(dp, port, args, queue), nprocs=dp, start_method="spawn")
        results[dp] = queue.get()
    first = results[args.data_parallel_sizes[0]][0]
    mb = 1024 * 1024
    print(f"GPT {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, {first['params'] / 1e6:.2f}M parameters, "
          f"{'bf16' if args.bf16 else 'fp32'}; micro-batch {MICRO_BATCH} x {MICRO_BATCHES} per rank; "
          f"overlap on; per rank, per step (median of {args.steps})")
    print(f"{'dp':>3} {'optimizer':<12}{'step ms':>9}{'payload MB':>12}{'ring MB':>9}{'ring/grad':>10}"
          f"{'weights+grads MB':>18}{'optimizer MB':>14}")
    for dp, rows in results.items():
        for sharded, row in zip((False, True), rows):
            print(f"{dp:>3} {'distributed' if sharded else 'replicated':<12}{row['step_ms']:>9.1f}"
                  f"{row['payload'] / mb:>12.2f}{row['ring'] / mb:>9.2f}{row['ring'] / row['grad_bytes']:>10.2f}"
                  f"{row['model_bytes'] / mb:>18.2f}{row['optimizer_bytes'] / mb:>14.2f}")


if __name__ == "__main__":
    main()
