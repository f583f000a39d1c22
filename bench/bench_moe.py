"""What a mixture of experts costs on CPU: the all-to-all bytes per token of expert parallelism, and the step
time of a mixture-of-experts model against the dense model with the same active parameters.

1. Dispatch: a world of ``ep`` gloo processes, each with its own tokens, runs one MoE layer forward and
   backward with its experts split over all of them (``--expert-model-parallel-size ep``). The collective
   counter (``process_groups.collectives``) gives the all-to-all bytes each rank hands in per token, beside
   the formula: each token's k rows of h values go out in the dispatch and come back in the combine, and
   the backward does both again, 4 k h bytes-per-value per token, of which a fraction (ep - 1) / ep
   leaves the rank when tokens spread evenly over the experts.
2. Step time: ``train_step`` of E experts with top-k routing and expert width F (the loop, and the grouped
   GEMM) against the dense model whose MLP is k F wide, which computes as many MLP weights per token; the
   median over the timed steps, one process.

    python bench/bench_moe.py [--ep 2 4] [--steps 5]

Timings only mean something side by side in one run: the ranks of the dispatch share the cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, TrainingConfig
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.moe import MoELayer
from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.initialize import free_local_port
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig

HIDDEN, EXPERTS, TOPK, EXPERT_WIDTH, SEQ, BATCH = 256, 8, 2, 512, 256, 4


def _model_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=4, hidden_size=HIDDEN, num_attention_heads=8, seq_length=SEQ, vocab_size=1024,
                  swiglu=True, ffn_hidden_size=TOPK * EXPERT_WIDTH, normalization="RMSNorm",
                  position_embedding_type="rope", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**fields, **overrides})


def _moe_fields(grouped: bool) -> dict:
    return dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_WIDTH, moe_aux_loss_coeff=1e-2,
                moe_grouped_gemm=grouped)


def _dispatch_rank(rank: int, world_size: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    state = initialize_model_parallel(expert_model_parallel_size=world_size)
    torch.manual_seed(0)
    layer = MoELayer(_model_config(**_moe_fields(False)), tp_config=TensorParallelConfig(),
                     ep_config=ExpertParallelConfig(ep_group=state.expert_model_parallel_group))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    torch.manual_seed(1 + rank)  # each rank its own tokens
    hidden = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    with collectives.count_collectives() as counter:
        output, _ = layer(hidden)
        output.sum().backward()
    received = layer.router.tokens_per_expert  # this rank's routed rows, by expert
    local = received.view(world_size, -1)[rank].sum().item() / received.sum().item()
    results.put((rank, counter.bytes.get(("all_to_all", "expert_model"), 0) / (SEQ * BATCH), 1 - local))
    destroy_model_parallel(state)
    dist.destroy_process_group()


def dispatch_bytes(ep: int) -> tuple[float, float]:
    """(all-to-all bytes per token per rank, the fraction of routed rows that left the rank), averaged."""
    port = free_local_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_dispatch_rank, args=(r, ep, port, results)) for r in range(ep)]
    for p in processes:
        p.start()
    rows = [results.get(timeout=600) for _ in processes]
    for p in processes:
        p.join()
    return statistics.mean(r[1] for r in rows), statistics.mean(r[2] for r in rows)


def step_runner(model: ModelConfig):
    """A function running one ``train_step`` of ``model`` on the next mock micro-batch, returning its seconds."""
    from megatron_lite.training.data_iterators import build_data_iterators
    from megatron_lite.training.loop import setup_model_and_optimizer, train_step
    from megatron_lite.training.run_plan import plan_run

    config = Config(model=model, training=TrainingConfig(micro_batch_size=BATCH, train_iters=1000),
                    data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))
    state = initialize_model_parallel()
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, state)
    train_iterator, _, _ = build_data_iterators(config, state, plan_run(config, state), 0, 0)

    def run() -> float:
        start = time.perf_counter()
        train_step(config, state, chunks, optimizer, scheduler, train_iterator, 1)
        return time.perf_counter() - start
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    print(f"MoE layer: hidden {HIDDEN}, {EXPERTS} experts of width {EXPERT_WIDTH}, top-{TOPK}, "
          f"{SEQ} x {BATCH} tokens per rank, fp32")
    formula = 4 * TOPK * HIDDEN * 4
    print(f"{'ep':>4} {'all-to-all bytes/token':>24} {'formula 4 k h x 4 B':>21} {'rows leaving the rank':>22} "
          f"{'(ep - 1) / ep':>14}")
    for ep in args.ep:
        measured, leaving = dispatch_bytes(ep)
        print(f"{ep:>4} {measured:>24.0f} {formula:>21} {leaving:>22.2f} {(ep - 1) / ep:>14.2f}")
    print(f"\nstep time, 4 layers, {SEQ} x {BATCH} tokens, one process (median of {args.steps}, taken in turn):")
    runners = {f"dense, MLP width k F = {TOPK * EXPERT_WIDTH}": step_runner(_model_config()),
               f"MoE {EXPERTS} x {EXPERT_WIDTH}, top-{TOPK}, loop": step_runner(_model_config(**_moe_fields(False))),
               f"MoE {EXPERTS} x {EXPERT_WIDTH}, top-{TOPK}, grouped GEMM":
                   step_runner(_model_config(**_moe_fields(True)))}
    times = {name: [] for name in runners}
    for round_ in range(args.steps + 1):  # in turn, so a change in the machine's load reaches all alike
        for name, run in runners.items():
            seconds = run()
            if round_:  # the first step warms the allocator up
                times[name].append(seconds)
    dense = statistics.median(next(iter(times.values())))
    for name, measured in times.items():
        seconds = statistics.median(measured)
        print(f"  {name:<40} {1000 * seconds:9.1f} ms  ({seconds / dense:.2f} x dense)")


if __name__ == "__main__":
    main()
