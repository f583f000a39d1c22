"""``--cluster local``: measure this machine as a cluster of N processes over gloo.

Every process measures at the same time (they share the cores, caches and memory
bus as training ranks do), taking the best of a few repeats of each. Compute is
timed in the process's own CPU time, so other jobs sharing the machine do not count
as slowness of the machine; communication, which waits on the other process, in
wall-clock time:

- the matmul rate: a 1024 x 1024 x 1024 matmul in the training dtype (the "peak");
- the matmul efficiency: forward + backward of one transformer layer of the planned
  model (a scaled-down one of the same kind past hidden size 1024), its FLOPs over its
  time at that rate. On a CPU the non-matmul work (GELU, attention, norms) is a large,
  shape-dependent share of a layer, so it is measured rather than assumed;
- memory bandwidth: a large copy (the optimizer step is bound by it);
- gloo all-reduce and send/receive time at two message sizes, giving latency and
  bandwidth per the ring formulas ``step_time`` uses.

The slowest process's numbers are the cluster's: it paces every collective.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.model import flops
from megatron_lite.planner.cluster import Cluster, Link
from megatron_lite.process_groups.initialize import free_local_port

REPEATS = 3
PROBE_MAX_HIDDEN = 1024
PROBE_MAX_TOKENS = 2048
MESSAGE_BYTES = (1 << 18, 1 << 23)  # two sizes: the line through them gives latency and bandwidth
COMMUNICATION_FIELDS = ("all_reduce_latency_s", "all_reduce_bus_bytes", "p2p_latency_s", "p2p_bytes")


@dataclass(frozen=True)
class Measurements:
    """One process's numbers."""

    matmul_flops: float  # per second
    layer_flops: float  # per second, one transformer layer's forward + backward
    memory_bytes: float  # per second, read + write
    all_reduce_latency_s: float  # per ring step
    all_reduce_bus_bytes: float  # per second
    p2p_latency_s: float
    p2p_bytes: float  # per second

    @staticmethod
    def typical(calibrations: list) -> "Measurements":
        """One process's numbers over several calibrations (e.g. before and after each of several runs):
        the median compute rates (CPU time already leaves other jobs out) and the fastest communication
        (wall-clock time, which other jobs only ever make slower)."""
        def combine(name: str):
            values = [getattr(c, name) for c in calibrations]
            if name in COMMUNICATION_FIELDS:
                return (min if name.endswith("latency_s") else max)(values)
            return statistics.median(values)
        return Measurements(**{f.name: combine(f.name) for f in dataclasses.fields(Measurements)})

    def slowest(self, other: "Measurements") -> "Measurements":
        fields = {f.name: (max if f.name.endswith("latency_s") else min)(getattr(self, f.name), getattr(other, f.name))
                  for f in dataclasses.fields(self)}
        return Measurements(**fields)


def _best_time(fn, repeats: int = REPEATS, clock=time.thread_time) -> float:
    fn()  # warm-up: first-call allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def matmul_rate(dtype: torch.dtype, size: int = 1024, clock=time.thread_time) -> float:
    """FLOP/s of a size^3 matmul. The default clock is this thread's CPU time (a one-thread rank's compute,
    whatever else runs); ``time.perf_counter`` times a multi-threaded matmul by the wall."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size ** 3 / _best_time(lambda: a @ b, clock=clock)


def memory_bandwidth(elements: int = 1 << 24) -> float:
    source = torch.ones(elements)
    target = torch.empty_like(source)
    return 2 * source.nbytes / _best_time(lambda: target.copy_(source))


def probe_model(model: ModelConfig) -> ModelConfig:
    """The planned model, or one layer of the same kind scaled to hidden size 1024 and 2048 tokens."""
    seq = min(model.seq_length, PROBE_MAX_TOKENS)
    if model.hidden_size <= PROBE_MAX_HIDDEN:
        return dataclasses.replace(model, num_layers=1, seq_length=seq, max_position_embeddings=max(
            seq, model.max_position_embeddings))
    scale = PROBE_MAX_HIDDEN / model.hidden_size
    heads = max(1, PROBE_MAX_HIDDEN // model.head_dim)
    groups = heads if model.num_query_groups == model.num_attention_heads else max(1, heads // 4)
    return dataclasses.replace(model, num_layers=1, hidden_size=heads * model.head_dim, num_attention_heads=heads,
                               num_query_groups=groups, ffn_hidden_size=max(64, int(model.ffn_hidden_size * scale)),
                               seq_length=seq, max_position_embeddings=seq)


def _dense(model: ModelConfig) -> ModelConfig:
    """A mixture of experts' layer timed as a dense one: its experts are the same matmuls, row for row (and a
    one-layer probe cannot hold the model's pattern of expert layers)."""
    unset = {f.name: f.default for f in dataclasses.fields(model) if f.name.startswith("moe_")}
    return dataclasses.replace(model, num_experts=None, **unset)


def layer_rate(model: ModelConfig, dtype: torch.dtype, micro_batch_size: int) -> float:
    """FLOP/s of one transformer layer's forward and backward (the model's own layer code)."""
    from megatron_lite.model.transformer_layer import TransformerLayer
    from megatron_lite.tensor_parallel import TensorParallelConfig
    from megatron_lite.tensor_parallel.random import model_parallel_seed

    probe = probe_model(_dense(model))
    model_parallel_seed(1234, 0)  # attention dropout draws from the tensor-parallel stream
    layer = TransformerLayer(probe, layer_number=0, tp_config=TensorParallelConfig(params_dtype=dtype))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    tokens = min(probe.seq_length * micro_batch_size, PROBE_MAX_TOKENS)
    batch = max(1, tokens // probe.seq_length)
    x = torch.randn(probe.seq_length, batch, probe.hidden_size, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    freqs = None
    if probe.position_embedding_type == "rope":
        from megatron_lite.model.embedding import rotary_freqs
        freqs = rotary_freqs(torch.arange(probe.seq_length)[None], probe.rotary_dim, probe.rotary_base)

    def step():
        layer(x, freqs).backward(grad)

    layer_flops = 3 * probe.seq_length * batch * flops.transformer_layer_flops_per_token(probe)
    return layer_flops / _best_time(step)


def _fit(small: float, large: float) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of the line through the two message sizes' times."""
    per_byte = max(1e-15, (large - small) / (MESSAGE_BYTES[1] - MESSAGE_BYTES[0]))
    return max(0.0, small - MESSAGE_BYTES[0] * per_byte), per_byte


def collective_rates(group=None) -> tuple[float, float, float, float]:
    """(all-reduce latency per ring step, bus bandwidth, p2p latency, p2p bandwidth) over ``group``."""
    k, rank = dist.get_world_size(group), dist.get_rank(group)
    all_reduce, p2p = [], []
    for size in MESSAGE_BYTES:
        buffer = torch.ones(size // 4)

        def reduce():
            dist.barrier(group)
            dist.all_reduce(buffer, group=group)

        def ping_pong():
            dist.barrier(group)
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)

        all_reduce.append(_best_time(reduce, clock=time.perf_counter))
        p2p.append(_best_time(ping_pong, clock=time.perf_counter) / 2)
    fixed, per_byte = _fit(*all_reduce)
    p2p_fixed, p2p_per_byte = _fit(*p2p)
    # A ring all-reduce: 2(k-1) steps, 2(k-1)/k of the message over the bus.
    return fixed / (2 * (k - 1)), 2 * (k - 1) / k / per_byte, p2p_fixed, 1 / p2p_per_byte


def measure(model: ModelConfig, dtype: torch.dtype, micro_batch_size: int, group=None) -> Measurements:
    """This process's numbers (all processes of ``group`` must call it together)."""
    rate = matmul_rate(dtype)
    layer = layer_rate(model, dtype, micro_batch_size)
    bandwidth = memory_bandwidth()
    latency, bus, p2p_latency, p2p = collective_rates(group)
    return Measurements(matmul_flops=rate, layer_flops=layer, memory_bytes=bandwidth, all_reduce_latency_s=latency,
                        all_reduce_bus_bytes=bus, p2p_latency_s=p2p_latency, p2p_bytes=p2p)


def local_cluster(measured: Measurements, *, num_processes: int, dtype: str) -> Cluster:
    """The cluster the measurements describe: one node of ``num_processes`` "GPUs" sharing host memory."""
    link = Link(bandwidth_gbps=measured.all_reduce_bus_bytes * 8 / 1e9, latency_us=measured.all_reduce_latency_s * 1e6,
                p2p_bandwidth_gbps=measured.p2p_bytes * 8 / 1e9, p2p_latency_us=measured.p2p_latency_s * 1e6)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Cluster(name="local", num_gpus=num_processes, gpus_per_node=num_processes,
                   gpu_memory_gb=host_memory / num_processes / 1e9, peak_tflops={dtype: measured.matmul_flops / 1e12},
                   memory_bandwidth_gbs=measured.memory_bytes / 1e9, intra_node=link, inter_node=link,
                   matmul_efficiency=min(1.0, measured.layer_flops / measured.matmul_flops), memory_allowance_gb=0.0,
                   device="cpu")


def _process(rank: int, world_size: int, port: int, target, args: tuple, results) -> None:
    torch.set_num_threads(1)  # one core per rank, as the distributed tests and CPU launches run
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results.put((rank, target(rank, world_size, *args)))
    finally:
        dist.destroy_process_group()


def run_on_local_processes(target, num_processes: int, *args) -> list:
    """``target(rank, num_processes, *args)`` in ``num_processes`` fresh processes of one gloo group on this
    machine (one intra-op thread each, as CPU training ranks run); their results, in rank order."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = free_local_port()
    processes = [context.Process(target=_process, args=(rank, num_processes, port, target, args, results))
                 for rank in range(num_processes)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(p.exitcode != 0 for p in processes):
        raise RuntimeError(f"a local process failed (exit codes {[p.exitcode for p in processes]}).")
    return [result for _, result in sorted(results.get() for _ in processes)]


def _measure(rank: int, world_size: int, model: ModelConfig, dtype: torch.dtype, micro_batch_size: int):
    return measure(model, dtype, micro_batch_size)


def calibrate_local(model: ModelConfig, dtype: torch.dtype, micro_batch_size: int, num_processes: int = 2) -> Cluster:
    """Start ``num_processes`` gloo processes on this machine, measure them, and describe them as a cluster."""
    if num_processes < 2:
        raise ValueError("calibrating communication needs at least 2 processes.")
    slowest = functools.reduce(Measurements.slowest, run_on_local_processes(_measure, num_processes, model, dtype,
                                                                            micro_batch_size))
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    return local_cluster(slowest, num_processes=num_processes, dtype=name)
