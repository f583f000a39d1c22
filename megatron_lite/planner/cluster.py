"""The machine a plan is for: GPUs, their memory and speed, and the links between them.

Presets hold vendors' documented numbers (every one can be overridden by its flag):

| preset | memory | dense bf16 / fp32 | HBM | NVLink, per GPU and direction | network per GPU |
|---|---|---|---|---|---|
| a100-40g | 40 GB | 312 / 19.5 TFLOP/s | 1,555 GB/s | 300 GB/s (NVLink 3) | 200 Gb/s (HDR InfiniBand) |
| a100-80g | 80 GB | 312 / 19.5 | 2,039 GB/s | 300 GB/s | 200 Gb/s |
| h100-80g | 80 GB | 989 / 67 | 3,350 GB/s | 450 GB/s (NVLink 4) | 400 Gb/s (NDR InfiniBand) |
| h200-141g | 141 GB | 989 / 67 | 4,800 GB/s | 450 GB/s | 400 Gb/s |

(SXM parts, DGX-style nodes of 8 with one NIC per GPU.) fp32 is the CUDA cores' rate, not
TF32's tensor-core rate (156 and 494 TFLOP/s): PyTorch runs fp32 matmuls in full precision
unless ``torch.backends.cuda.matmul.allow_tf32`` is set, and we leave that default, as
Megatron-LM does (it has no TF32 switch; its runs are bf16). Link numbers are used as the
bus bandwidth a ring collective reaches; NCCL gets close to them on large messages, so
communication estimates are on the optimistic side. Latency per hop: 5 us in a node,
10 us across nodes. The matmul efficiency (the fraction of the dense peak a
transformer layer's compute sustains, non-matmul work included) defaults to 0.60 on
A100 and 0.50 on H100/H200, whose larger peak is harder to feed; with them a GPT-3
175B layout on 1,024 A100s comes out near the published 44-52% MFU (docs/reference.md
section 7). The memory
allowance (3 GB) covers the CUDA context and library workspaces, communication
buffers and allocator fragmentation.

``--cluster local`` measures this machine instead (``calibrate.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_lite.config import ConfigError


@dataclass(frozen=True)
class Link:
    """One level of the network, per GPU: collectives and point-to-point transfers."""

    bandwidth_gbps: float  # bus bandwidth of collectives, gigabits per second
    latency_us: float  # per step of a ring collective
    p2p_bandwidth_gbps: Optional[float] = None  # None: as collectives
    p2p_latency_us: Optional[float] = None

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def p2p_bytes_per_second(self) -> float:
        return (self.p2p_bandwidth_gbps or self.bandwidth_gbps) * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6

    @property
    def p2p_latency_s(self) -> float:
        return (self.latency_us if self.p2p_latency_us is None else self.p2p_latency_us) * 1e-6


@dataclass(frozen=True)
class Cluster:
    name: str
    num_gpus: int
    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: dict  # dense matmul peak by training dtype: "bf16", "fp16", "fp32"
    memory_bandwidth_gbs: float  # device memory, gigabytes per second (the optimizer step is bound by it)
    intra_node: Link
    inter_node: Link
    matmul_efficiency: float
    memory_allowance_gb: float = 3.0
    device: str = "cuda"  # whose kernels' activation accounting applies (activations.TRAITS)

    def peak(self, dtype: str) -> float:
        return self.peak_tflops[dtype]

    def spans_nodes(self, stride: int, group_size: int) -> bool:
        """Whether a group of ranks ``start + k * stride`` (k < group_size) sits on more than one node.

        Groups of the rank grid start at a multiple of ``stride * group_size`` (parallel_state's
        order), so the group fits in a node exactly when that block does.
        """
        block = stride * group_size
        return group_size > 1 and (block > self.gpus_per_node or self.gpus_per_node % block != 0)

    def link(self, stride: int, group_size: int) -> Link:
        """The link the group's traffic crosses: the network as soon as it spans nodes."""
        return self.inter_node if self.spans_nodes(stride, group_size) else self.intra_node


# Dense bf16 (and fp16) tensor-core peak per device, TFLOP/s, by the name CUDA reports (docs/reference.md
# section 7): the presets' numbers, and the MFU of a training run's log line (training.metrics).
BF16_PEAK_TFLOPS = {"A100": 312.0, "A800": 312.0, "H100": 989.0, "H800": 989.0, "H200": 989.0, "L40S": 362.0}


def _gpu(name: str, memory_gb: float, bf16: float, fp32: float, hbm: float, nvlink_gbytes: float,
         network_gbits: float, efficiency: float) -> Cluster:
    return Cluster(name=name, num_gpus=8, gpus_per_node=8, gpu_memory_gb=memory_gb,
                   peak_tflops={"bf16": bf16, "fp16": bf16, "fp32": fp32}, memory_bandwidth_gbs=hbm,
                   intra_node=Link(nvlink_gbytes * 8, 5.0), inter_node=Link(network_gbits, 10.0),
                   matmul_efficiency=efficiency)


PRESETS = {
    "a100-40g": _gpu("a100-40g", 40, BF16_PEAK_TFLOPS["A100"], 19.5, 1555.0, 300.0, 200.0, 0.60),
    "a100-80g": _gpu("a100-80g", 80, BF16_PEAK_TFLOPS["A100"], 19.5, 2039.0, 300.0, 200.0, 0.60),
    "h100-80g": _gpu("h100-80g", 80, BF16_PEAK_TFLOPS["H100"], 67.0, 3350.0, 450.0, 400.0, 0.50),
    "h200-141g": _gpu("h200-141g", 141, BF16_PEAK_TFLOPS["H200"], 67.0, 4800.0, 450.0, 400.0, 0.50),
}


def customise(cluster: Cluster, *, num_gpus: Optional[int] = None, gpus_per_node: Optional[int] = None,
              gpu_memory_gb: Optional[float] = None, gpu_peak_tflops: Optional[float] = None,
              intra_node_bandwidth_gbps: Optional[float] = None, inter_node_bandwidth_gbps: Optional[float] = None,
              matmul_efficiency: Optional[float] = None, memory_allowance_gb: Optional[float] = None,
              dtype: str = "bf16") -> Cluster:
    """A preset with the flags the user gave replacing its numbers."""
    changes = {}
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    if num_gpus is not None:
        changes["num_gpus"] = num_gpus
    elif gpus_per_node is not None:
        changes["num_gpus"] = gpus_per_node
    if gpu_memory_gb is not None:
        changes["gpu_memory_gb"] = gpu_memory_gb
    if gpu_peak_tflops is not None:
        changes["peak_tflops"] = {**cluster.peak_tflops, dtype: gpu_peak_tflops}
    if intra_node_bandwidth_gbps is not None:
        changes["intra_node"] = dataclasses.replace(cluster.intra_node, bandwidth_gbps=intra_node_bandwidth_gbps)
    if inter_node_bandwidth_gbps is not None:
        changes["inter_node"] = dataclasses.replace(cluster.inter_node, bandwidth_gbps=inter_node_bandwidth_gbps)
    if matmul_efficiency is not None:
        changes["matmul_efficiency"] = matmul_efficiency
    if memory_allowance_gb is not None:
        changes["memory_allowance_gb"] = memory_allowance_gb
    result = dataclasses.replace(cluster, **changes)
    check(result)
    return result


def check(cluster: Cluster) -> None:
    for flag, value in [("--num-gpus", cluster.num_gpus), ("--gpus-per-node", cluster.gpus_per_node),
                        ("--gpu-memory-gb", cluster.gpu_memory_gb),
                        ("--intra-node-bandwidth-gbps", cluster.intra_node.bandwidth_gbps),
                        ("--inter-node-bandwidth-gbps", cluster.inter_node.bandwidth_gbps)]:
        if value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}.")
    if not 0 < cluster.matmul_efficiency <= 1:
        raise ConfigError(f"--matmul-efficiency must be in (0, 1], got {cluster.matmul_efficiency}.")
    if cluster.num_gpus > cluster.gpus_per_node and cluster.num_gpus % cluster.gpus_per_node:
        raise ConfigError(f"--num-gpus ({cluster.num_gpus}) must be a multiple of --gpus-per-node "
                          f"({cluster.gpus_per_node}): nodes are whole.")
