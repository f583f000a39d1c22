"""Muon (``--optimizer muon``): momentum SGD whose update of each weight matrix is orthogonalised
(docs/reference.md section 17), as Megatron-LM's emerging-optimizers Muon; the other parameters (embeddings,
output layer, norms, biases) take ``--muon-scalar-optimizer`` (``chained_optimizer.py`` joins the two).

For a matrix W with gradient G (after clipping), one step is

    W <- W (1 - lr wd)                         decoupled weight decay
    M <- momentum M + (1 - momentum) G         --muon-momentum
    U <- G + momentum (M - G) if --muon-nesterov else M
    W <- W - lr * extra * scale(shape) * NS(U) --muon-extra-scale-factor, --muon-scale-mode, newton_schulz.py

Only NS is not element-wise, which is where layouts matter:

- fused weights: the QKV weight holds per query group [q heads, k, v], SwiGLU's fc1 [gate; up]; each
  component is orthogonalised (and scaled) as the matrix it is (``--muon-no-split-qkv`` turns this off).
  Each expert of a mixture-of-experts layer is its own parameter, so its own matrix.
- tensor parallelism (``--muon-tp-mode``): ``duplicated`` all-gathers the shards and every rank
  orthogonalises the whole matrix; ``distributed`` keeps the shards and sums the Gram matrix over the
  tensor-parallel ranks (``newton_schulz.py``); both equal one process. ``blockwise`` orthogonalises each
  shard alone: no communication, but the update then depends on the tensor-parallel size.
- the distributed optimizer (ZeRO-1/2/3): a rank holds a flat slice of each bucket, which can cut a matrix
  anywhere. Each matrix is given whole to one data-parallel rank (the least loaded, biggest first): the
  ranks' slices of its U are summed into that owner (each rank contributes its own elements, zeros elsewhere),
  the owner orthogonalises it, once, and broadcasts the result, of which each rank keeps its slice. A rank
  holds whole only the matrices it owns (about 1/dp of them) plus one matrix in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.optimizer.newton_schulz import newton_schulz, scale_factor
from megatron_lite.process_groups import collectives


@dataclass(eq=False)
class MuonMatrix:
    """One weight matrix as this rank holds it (a tensor-parallel shard, whole over data-parallel ranks).

    ``parts``: the rows of each fused matrix within one of ``blocks`` row blocks (QKV: (q, k, v) rows of each
    local query group; SwiGLU fc1: (gate, up) in one block); ``(rows,)`` in one block when nothing is fused.
    Gathering column-parallel shards stacks their blocks, so a gathered QKV (or fc1) has tp times the blocks.
    """

    name: str
    shape: torch.Size
    blocks: int
    parts: tuple
    partition_dim: Optional[int]  # the dimension split over ``tp_group``, None when whole here
    tp_group: object
    data_parallel_group: object  # the ranks that each hold a slice of it (None: whole here)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def fused_parts(model_chunks: list, split: bool) -> dict:
    """parameter -> (its rows -> (blocks, parts)) for the fused QKV and SwiGLU fc1 weights (none unless ``split``).
    A function of the rows: under ZeRO-3 the parameter is empty here, its shape lives in its bucket."""
    fused: dict = {}
    if not split:
        return fused
    for chunk in model_chunks:
        swiglu = chunk.module.config.swiglu
        for module in chunk.module.modules():
            qkv = getattr(getattr(module, "linear_qkv", None), "weight", None)
            if qkv is not None and hasattr(module, "heads_per_group"):
                parts = (module.heads_per_group * module.head_dim, module.head_dim, module.head_dim)
                fused[qkv] = lambda rows, parts=parts: (rows // sum(parts), parts)
            fc1 = getattr(getattr(module, "linear_fc1", None), "weight", None)
            if swiglu and fc1 is not None:
                fused[fc1] = lambda rows: (1, (rows // 2, rows // 2))
    return fused


def uses_muon(param, shape: torch.Size) -> bool:
    """Muon takes the 2-D weights but the embeddings and the output layer (Megatron-LM's rule); ``shape`` is the
    parameter's whole shape (empty between uses under ZeRO-3)."""
    return len(shape) == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


class Muon(torch.optim.Optimizer):
    """Muon over main parameters that are 1-D slices of matrices.

    Args:
        group: the param group (its "params" are the main parameters; lr, weight_decay and Megatron's keys).
        slices: main parameter -> (its MuonMatrix, first element, end) within the flattened matrix.
        matrices: every matrix of the model chunks, in one order on every rank (sharded matrices need every
            data-parallel rank in each collective, also a rank that holds none of it).
        config: --muon-* flags.
    """

    def __init__(self, group: dict, *, slices: dict, matrices: list, config) -> None:
        super().__init__([group], {"lr": config.lr, "weight_decay": config.weight_decay,
                                   "momentum": config.muon_momentum, "nesterov": config.muon_nesterov})
        self.slices = slices
        self.matrices = matrices
        self.config = config
        self.owners = _assign_owners(matrices)

    def initial_state(self, main: torch.Tensor) -> dict:
        return {"momentum_buffer": torch.zeros_like(main)}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        group = self.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        updates = {}
        for main in group["params"]:
            buffer = self.state[main]["momentum_buffer"]
            main.mul_(1.0 - lr * group["weight_decay"])
            buffer.lerp_(main.grad, 1.0 - momentum)
            updates[main] = main.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        for main, update in self._orthogonalise(updates).items():
            main.add_(update, alpha=-lr)

    def _orthogonalise(self, updates: dict) -> dict:
        """main parameter -> its slice of the scaled, orthogonalised update.

        A rank holds whole only the matrices it owns (their U, then their result) and one matrix in flight:
        a matrix held whole nowhere else is orthogonalised and cut to its slice at once, and a broadcast
        result is cut to this rank's slice before the next arrives."""
        by_matrix = {self.slices[main][0]: (main, update) for main, update in updates.items()}
        result, owned = {}, {}  # owned: matrix -> its full orthogonalised update, for the matrices this rank owns
        for matrix in self.matrices:
            if collectives.world_size(matrix.data_parallel_group) == 1:
                if matrix in by_matrix:
                    main, update = by_matrix[matrix]
                    result[main] = self._orthogonalise_matrix(matrix, update.view(matrix.shape)).view(-1)
                continue
            # Sum every rank's slice into the owner: its whole U (zeros where a rank holds nothing).
            gathered = torch.zeros(matrix.numel, dtype=torch.float32, device=self._device(by_matrix))
            if matrix in by_matrix:
                main, update = by_matrix[matrix]
                _, start, end = self.slices[main]
                gathered[start:end] = update
            owner = self._owner_rank(matrix)
            collectives.reduce(gathered, dst=owner, group=matrix.data_parallel_group)
            if dist.get_rank() == owner:
                owned[matrix] = gathered
        # Orthogonalise (each rank its own, in the shared order, so the tensor-parallel peers, which own
        # the same matrices, meet in the same collectives), then hand each result to the ranks that hold it.
        for matrix in list(owned):
            owned[matrix] = self._orthogonalise_matrix(matrix, owned[matrix].view(matrix.shape)).view(-1)
        for matrix in self.matrices:
            if collectives.world_size(matrix.data_parallel_group) == 1:
                continue
            full = owned.pop(matrix, None)
            if full is None:
                full = torch.empty(matrix.numel, dtype=torch.float32, device=self._device(by_matrix))
            collectives.broadcast(full, src=self._owner_rank(matrix), group=matrix.data_parallel_group)
            if matrix in by_matrix:
                main = by_matrix[matrix][0]
                _, start, end = self.slices[main]
                result[main] = full[start:end].clone()  # a view would keep the whole matrix alive
        return result

    def _owner_rank(self, matrix: MuonMatrix) -> int:
        return dist.get_global_rank(matrix.data_parallel_group, self.owners[matrix])

    @staticmethod
    def _device(by_matrix: dict) -> torch.device:
        return next((main.device for main, _ in by_matrix.values()), torch.device("cpu"))

    def _orthogonalise_matrix(self, matrix: MuonMatrix, update: torch.Tensor) -> torch.Tensor:
        """NS of ``update`` (this rank's shard of ``matrix``), component by component, scaled."""
        tp_size = collectives.world_size(matrix.tp_group) if matrix.partition_dim is not None else 1
        mode = self.config.muon_tp_mode if tp_size > 1 else "blockwise"
        if mode == "duplicated":
            dim = matrix.partition_dim
            shards = torch.empty((tp_size, *update.shape), dtype=update.dtype, device=update.device)
            collectives.all_gather_into_tensor(shards.view(-1), update.reshape(-1), matrix.tp_group)
            full = torch.cat(list(shards), dim=dim)
            blocks = matrix.blocks * tp_size if dim == 0 else matrix.blocks
            orthogonal = self._orthogonalise_parts(full, blocks, matrix.parts)
            return orthogonal.chunk(tp_size, dim=dim)[collectives.rank(matrix.tp_group)].contiguous()
        if mode == "distributed":
            return self._orthogonalise_parts(update, matrix.blocks, matrix.parts, tp_group=matrix.tp_group,
                                             partition_dim=matrix.partition_dim)
        return self._orthogonalise_parts(update, matrix.blocks, matrix.parts)

    def _orthogonalise_parts(self, x: torch.Tensor, blocks: int, parts: tuple, tp_group=None,
                             partition_dim: Optional[int] = None) -> torch.Tensor:
        """Each fused component of ``x`` orthogonalised and scaled as the whole matrix it is (its shard of it
        under ``tp_group``, split along ``partition_dim``)."""
        config = self.config
        rows, cols = x.shape
        pieces = torch.split(x.reshape(blocks, sum(parts), cols), list(parts), dim=1)
        out = []
        for piece in pieces:
            component = piece.reshape(-1, cols)
            shape = list(component.shape)
            if tp_group is not None:
                shape[partition_dim] *= collectives.world_size(tp_group)
            orthogonal = newton_schulz(component, steps=config.muon_num_ns_steps,
                                       coefficient_type=config.muon_coefficient_type,
                                       bf16=config.muon_fp32_matmul_prec != "high", tp_group=tp_group,
                                       transpose=None if tp_group is None else partition_dim == 0)
            scale = scale_factor(*shape, config.muon_scale_mode) * config.muon_extra_scale_factor
            out.append((orthogonal * scale).reshape(blocks, -1, cols))
        return torch.cat(out, dim=1).reshape(rows, cols)


def _assign_owners(matrices: list) -> dict:
    """matrix -> the data-parallel rank that orthogonalises it (``assign_owners`` within each group)."""
    by_group: dict = {}
    for matrix in matrices:
        if collectives.world_size(matrix.data_parallel_group) > 1:
            by_group.setdefault(id(matrix.data_parallel_group), []).append(matrix)
    owners = {}
    for group in by_group.values():
        size = collectives.world_size(group[0].data_parallel_group)
        owners.update(assign_owners({m: (m.name, tuple(m.shape)) for m in group}, size))
    return owners


def assign_owners(shapes: dict, size: int) -> dict:
    """key -> which of ``size`` ranks orthogonalises it, for the matrices ``shapes`` (key -> (name, (rows, cols))):
    biggest first, each to the least loaded rank (NS costs about rows x cols x min(rows, cols)). It reads only
    names and shapes, so every rank, and the planner, finds the same."""
    owners, load = {}, [0.0] * size
    for key, (name, shape) in sorted(shapes.items(), key=lambda item: (-ns_cost(item[1][1]), item[1][0])):
        owner = min(range(size), key=lambda r: (load[r], r))
        load[owner] += ns_cost(shape)
        owners[key] = owner
    return owners


def ns_cost(shape: tuple) -> float:
    rows, cols = shape
    return float(rows * cols * min(rows, cols))
