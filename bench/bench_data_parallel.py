"""Per-step time, communication and memory of data parallelism under every sharding strategy
(--data-parallel-sharding-strategy no_shard, optim, optim_grads, optim_grads_params: ZeRO 0 to 3).

For each data-parallel size a world of that many gloo processes trains a small GPT
(fixed micro-batch per rank, so the global batch grows with dp) and reports, per rank
and per step:

- step time (median over the timed steps; the slowest rank's time counts);
- ring volume: what a ring algorithm sends per rank, 2(d-1)/d x size for an all-reduce,
  (d-1)/d x size for a reduce-scatter, (d-1) x shard for an all-gather, in units of the
  model's gradient bytes, beside the ZeRO paper's count (2 for DP and stages 1-2, 3 for
  stage 3, times (d-1)/d; with m micro-batches ZeRO-2 reduce-scatters m times, ZeRO-3
  gathers 2m times and reduce-scatters m times);
- memory, measured from the live tensors (``optimizer.memory_report()``): parameters,
  gradients, optimizer state, and the peak of parameters during a step (ZeRO-3 gathers);
  beside each, what the sharding should give: the unsharded bytes / dp for a sharded part,
  plus one bucket-sized staging buffer for ZeRO-2/3 gradients (two with --overlap).

    python bench/bench_data_parallel.py [--data-parallel-sizes 1 2 4] [--steps 5] [--bf16] [--overlap]

On a machine with fewer cores than processes the ranks share cores, so step times
grow with dp for reasons unrelated to communication; the byte columns are exact.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lite.config import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_lite.process_groups.initialize import free_local_port
from megatron_lite.config import SHARDING_STRATEGIES
from megatron_lite.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.model.builder import FSDP_UNIT_MODULES
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig

MODEL = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024,
                    hidden_dropout=0.0, attention_dropout=0.0)
MICRO_BATCH = 2
PAPER_RING = {"no_shard": 2, "optim": 2, "optim_grads": 2, "optim_grads_params": 3}  # x Psi, one micro-batch


def ring_bytes(op: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for a collective whose local tensor is ``payload`` bytes."""
    d = group_size
    return {"all_reduce": 2 * (d - 1) / d * payload, "reduce_scatter": (d - 1) / d * payload,
            "all_gather": (d - 1) * payload}.get(op, 0.0)


def train_step(ddp, optimizer, parallel_state, generator, micro_batches: int):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    for i in range(micro_batches):
        tokens = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH, MODEL.seq_length + 1), generator=generator)
        with ddp.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
            loss = ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean() / micro_batches
            optimizer.scale_loss(loss).backward()
    finalize_model_grads([ddp], parallel_state=parallel_state)
    optimizer.step()


def run(parallel_state, strategy: str, args) -> dict:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = ParallelConfig(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=args.overlap,
                            overlap_param_gather=args.overlap and strategy != "no_shard",
                            ddp_bucket_size=args.bucket_size)
    model = GPTModel(MODEL, TensorParallelConfig(parallel_state.tensor_model_parallel_group, params_dtype=dtype))
    initialize_weights([model], MODEL, parallel_state, seed=1234)
    psi = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model, config=config, data_parallel_group=parallel_state.data_parallel_group,
                                  fsdp_unit_modules=FSDP_UNIT_MODULES)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4), [ddp], parallel_state=parallel_state,
                                       parallel_config=config, params_dtype=dtype)
    generator = torch.Generator().manual_seed(parallel_state.data_parallel_rank)
    train_step(ddp, optimizer, parallel_state, generator, args.micro_batches)  # warm-up: allocator, connections
    ddp.reset_peak_memory()
    dp = parallel_state.data_parallel_world_size
    times, payload = [], {}
    for _ in range(args.steps):
        collectives.all_reduce(torch.zeros(1), parallel_state.data_parallel_group)  # start together
        start = time.perf_counter()
        with collectives.count_collectives() as counter:
            train_step(ddp, optimizer, parallel_state, generator, args.micro_batches)
            ddp.finish_param_sync()  # an overlapped gather belongs to this step
        elapsed = torch.tensor([time.perf_counter() - start])
        collectives.all_reduce(elapsed, parallel_state.data_parallel_group, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        for (op, group), size in counter.bytes.items():
            if group == "data":
                payload[op] = payload.get(op, 0) + size
    report = optimizer.memory_report()
    grad_bytes = 4 if dtype == torch.bfloat16 else dtype.itemsize  # bf16 accumulates gradients in fp32
    return {"step_ms": statistics.median(times) * 1e3, "psi": psi,
            "ring": sum(ring_bytes(op, b, dp) for op, b in payload.items()) / args.steps / (grad_bytes * psi),
            "params": report["parameter_bytes"], "peak_params": report["peak_parameter_bytes"],
            "grads": report["gradient_bytes"], "optimizer": report["optimizer_state_bytes"],
            "bucket": max(b.numel for b in ddp.buckets) * grad_bytes}


def expected(strategy: str, dp: int, unsharded: dict, row: dict, overlap: bool) -> dict:
    """What sharding should leave per rank: the unsharded bytes / dp for each sharded part, plus the
    staging buffers (one bucket, two with overlap) for sharded gradients."""
    level = SHARDING_STRATEGIES.index(strategy)
    return {"params": unsharded["params"] / (dp if level >= 3 else 1),
            "grads": unsharded["grads"] / dp + (1 + overlap) * row["bucket"] if level >= 2 else unsharded["grads"],
            "optimizer": unsharded["optimizer"] / (dp if level >= 1 else 1)}


def worker(rank, world_size, port, args, queue):
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state = initialize_model_parallel(1, 1, rank=rank, world_size=world_size)
    rows = {strategy: run(parallel_state, strategy, args) for strategy in SHARDING_STRATEGIES}
    if rank == 0:
        queue.put(rows)
    destroy_model_parallel(parallel_state)
    if world_size > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-parallel-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=1, help="per rank and step (1: the paper's counts)")
    parser.add_argument("--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size in elements")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights, fp32 gradients (default fp32)")
    parser.add_argument("--overlap", action="store_true", help="--overlap-grad-reduce and --overlap-param-gather")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    results = {}
    for dp in args.data_parallel_sizes:
        port = free_local_port()
        queue = context.SimpleQueue()
        mp.start_processes(worker, args=(dp, port, args, queue), nprocs=dp, start_method="spawn")
        results[dp] = queue.get()
    unsharded = results[args.data_parallel_sizes[0]]["no_shard"]
    mb = 1024 * 1024
    print(f"GPT {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, {unsharded['psi'] / 1e6:.2f}M parameters, "
          f"{'bf16' if args.bf16 else 'fp32'}; micro-batch {MICRO_BATCH} x {args.micro_batches} per rank; overlap "
          f"{'on' if args.overlap else 'off'}; per rank and step (median of {args.steps}); MB measured (expected)")
    print(f"{'dp':>3} {'strategy':<19}{'step ms':>8}{'ring/grads':>11}{'paper':>6}  {'params':>15}{'peak params':>12}"
          f"  {'grads':>15}  {'optimizer':>15}")
    for dp, rows in results.items():
        for strategy, row in rows.items():
            want = expected(strategy, dp, unsharded, row, args.overlap)
            paper = PAPER_RING[strategy] * (dp - 1) / dp
            cells = [f"{row[k] / mb:7.2f} ({want[k] / mb:5.2f})" for k in ("params", "grads", "optimizer")]
            print(f"{dp:>3} {strategy:<19}{row['step_ms']:>8.1f}{row['ring']:>11.2f}{paper:>6.2f}  {cells[0]:>15}"
                  f"{row['peak_params'] / mb:>12.2f}  {cells[1]:>15}  {cells[2]:>15}")


if __name__ == "__main__":
    main()
