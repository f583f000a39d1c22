"""What one ``--optimizer muon`` step costs a rank beyond the element-wise update: the whole matrices it holds
while orthogonalising them, and the time of the Newton-Schulz iterations and of moving the matrices.

``optimizer/muon.py`` does, per weight matrix (this rank's tensor-parallel shard of it):

- sharded over data-parallel ranks (``--use-distributed-optimizer``, ZeRO-2/3): every rank's slice is summed
  into the matrix's owner (``assign_owners``: biggest first, to the least loaded rank), the owner
  orthogonalises it and broadcasts the result. A rank holds whole the matrices it owns, plus one in flight;
- otherwise it orthogonalises the matrix itself, one matrix at a time.

Newton-Schulz on an m x n component (m <= n: the iteration runs on the shorter side) costs per step
4 m^2 n + 2 m^3 FLOPs (X X^T, the polynomial in it, its product with X) and holds X, the Gram matrix, the
polynomial and the new X: 2 m n + 2 m^2 elements. Fused QKV and SwiGLU's fc1 are orthogonalised component by
component unless --muon-no-split-qkv. Under tensor parallelism ``--muon-tp-mode duplicated`` all-gathers the
shards and every rank iterates on the whole matrix; ``distributed`` iterates on its shard and all-reduces the
Gram matrix every step; ``blockwise`` iterates on its shard alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.optimizer.muon import assign_owners
from megatron_lite.planner.cluster import Cluster, Link
from megatron_lite.planner.parameters import ParamSpec, rank_chunks

FP32 = 4


@dataclass(frozen=True)
class MuonStep:
    workspace_bytes: int  # held during the step: the owned whole matrices, one in flight, Newton-Schulz's buffers
    owned_elements: int  # of the matrices sharded over data-parallel ranks, the elements of those this rank owns
    flops: float  # this rank's Newton-Schulz FLOPs
    moved_bytes: tuple  # (bytes, group size, group) of each collective; group: "data", "tensor", or the experts'
    # "expert_data", "expert_tensor"


def _components(spec: ParamSpec, config: Config) -> list[tuple[int, int]]:
    """The matrices NS orthogonalises in ``spec`` (this rank's shard): QKV as q, k and v, SwiGLU's fc1 as gate and
    up, when split (``optimizer/muon.py``'s ``fused_parts``)."""
    rows, cols = spec.matrix
    model = config.model
    if not config.optimizer.muon_split_qkv:
        return [(rows, cols)]
    if spec.name.endswith("self_attention.linear_qkv.weight") and not model.multi_latent_attention:
        heads, groups = model.num_attention_heads, model.num_query_groups
        per_row = rows // (heads + 2 * groups)
        return [(heads * per_row, cols), (groups * per_row, cols), (groups * per_row, cols)]
    if spec.name.endswith("linear_fc1.weight") and model.swiglu:
        return [(rows // 2, cols), (rows // 2, cols)]
    return [(rows, cols)]


def _iterated(shape: tuple, spec: ParamSpec, config: Config, tp: int) -> tuple[int, int]:
    """The shape one rank iterates on: the whole component under --muon-tp-mode duplicated, else its shard."""
    if spec.partition_dim is None or tp == 1 or config.optimizer.muon_tp_mode != "duplicated":
        return shape
    rows, cols = shape
    return (rows * tp, cols) if spec.partition_dim == 0 else (rows, cols * tp)


def _ns_flops(shape: tuple, steps: int) -> float:
    m, n = sorted(shape)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def _ns_buffer_elements(shape: tuple) -> int:
    m, n = sorted(shape)
    return 2 * m * n + 2 * m * m


def muon_step(config: Config, pipeline_rank: int, *, data_parallel_size: int, expert_data_parallel_size: int,
              data_parallel_rank: int = 0, expert_data_parallel_rank: int = 0) -> MuonStep:
    """The Muon step of rank (pipeline_rank, data_parallel_rank) of the layout in ``config``; dense matrices are
    sharded over ``data_parallel_size`` ranks, experts over ``expert_data_parallel_size`` (when the
    --data-parallel-sharding-strategy shards at all)."""
    parallel, optimizer = config.parallel, config.optimizer
    sharded = parallel.data_parallel_sharding_strategy != "no_shard"
    matrices = [s for chunk in rank_chunks(config, pipeline_rank) for s in chunk if s.matrix]
    flops, moved, owned_elements, largest, buffers = 0.0, [], 0, 0, 0
    for expert in (False, True):
        specs = [s for s in matrices if s.expert == expert]
        size, rank = ((expert_data_parallel_size, expert_data_parallel_rank) if expert
                      else (data_parallel_size, data_parallel_rank))
        tp = parallel.expert_tensor_size if expert else parallel.tensor_model_parallel_size
        data, tensor = ("expert_data", "expert_tensor") if expert else ("data", "tensor")
        owners = assign_owners({s.name: (s.name, s.matrix) for s in specs}, size) if sharded and size > 1 else {}
        for spec in specs:
            mine = owners.get(spec.name, rank) == rank
            largest = max(largest, spec.elements)
            if spec.name in owners:
                moved += [(spec.elements * FP32, size, data)] * 2  # the sum into the owner, the broadcast back
                owned_elements += spec.elements if mine else 0
            if spec.partition_dim is not None and tp > 1 and optimizer.muon_tp_mode == "duplicated" and mine:
                moved.append((spec.elements * tp * FP32, tp, tensor))
            if not mine:
                continue
            for shape in _components(spec, config):
                iterated = _iterated(shape, spec, config, tp)
                flops += _ns_flops(iterated, optimizer.muon_num_ns_steps)
                buffers = max(buffers, _ns_buffer_elements(iterated))
                if spec.partition_dim is not None and tp > 1 and optimizer.muon_tp_mode == "distributed":
                    gram = min(shape) ** 2 * FP32
                    moved += [(gram, tp, tensor)] * (optimizer.muon_num_ns_steps * 2)  # all-reduce: two halves
    # bf16 iterations (--muon-fp32-matmul-prec medium, low) halve the buffers.
    buffer_bytes = buffers * (FP32 if optimizer.muon_fp32_matmul_prec == "high" else 2)
    return MuonStep(workspace_bytes=(owned_elements + largest) * FP32 + buffer_bytes, owned_elements=owned_elements,
                    flops=flops, moved_bytes=tuple(moved))


def muon_step_s(step: MuonStep, config: Config, cluster: Cluster, links: dict[str, Link]) -> float:
    """Seconds of Newton-Schulz at the matmul rate (bf16 unless --muon-fp32-matmul-prec high) and of the step's
    collectives, each a ring pass of its bytes over its group's link in ``links`` (none of it overlapped)."""
    dtype = "fp32" if config.optimizer.muon_fp32_matmul_prec == "high" else "bf16"
    compute = step.flops / (cluster.peak(dtype) * 1e12 * cluster.matmul_efficiency)
    moves = 0.0
    for message, size, group in step.moved_bytes:
        link = links[group]
        moves += (size - 1) * link.latency_s + (size - 1) / size * message / link.bytes_per_second
    return compute + moves
