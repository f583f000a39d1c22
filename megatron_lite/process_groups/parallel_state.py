"""Process groups for tensor, context, pipeline, data and expert parallelism.

The world is a grid laid out in rank order with tensor-parallel ranks adjacent (they
talk the most, so they share a node), then context-parallel, then data-parallel,
then pipeline (Megatron-LM's ``tp-cp-dp-pp`` order):

    rank = ((pipeline * dp + data) * cp + context) * tp + tensor

Mixture-of-experts layers see the ``tp x cp x dp`` ranks of each pipeline stage
through a second grid of the same ranks (Megatron-LM's expert grid,
``etp-ep-edp-pp``): expert-tensor ranks fastest, then expert-model (the ranks
that split the experts between them), then expert-data (the replicas of one
expert shard, whose gradients are reduced together):

    rank = pipeline * (tp * cp * dp) + (expert_data * ep + expert_model) * etp + expert_tensor

``RankLayout`` computes every group as plain lists of ranks, without any process
group, so a 1,024-rank layout can be checked in milliseconds. ``ParallelState``
holds one rank's groups and is passed explicitly to every module that talks.
"""
from __future__ import annotations

import datetime
import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.collectives import MockGroup
from megatron_lite.config import ConfigError

DENSE_AXES = ("tensor", "context", "data", "pipeline")  # fastest first
EXPERT_AXES = ("expert_tensor", "expert_model", "expert_data", "pipeline")


@dataclass(frozen=True)
class RankLayout:
    """Pure arithmetic of the rank grid and of its expert view."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None: the tensor-parallel size, as in Megatron-LM

    def __post_init__(self) -> None:
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if tp < 1 or pp < 1 or self.world_size < 1:
            raise ConfigError(
                f"world size ({self.world_size}), --tensor-model-parallel-size ({tp}) and "
                f"--pipeline-model-parallel-size ({pp}) must all be at least 1.")
        if cp < 1 or self.expert_model_parallel_size < 1 or self.etp < 1:
            raise ConfigError(
                f"--context-parallel-size ({cp}), --expert-model-parallel-size ({self.expert_model_parallel_size}) "
                f"and --expert-tensor-parallel-size ({self.etp}) must all be at least 1.")
        if self.world_size % (tp * pp * cp) != 0:
            cp_text = f" x context-parallel ({cp})" if cp > 1 else ""
            cp_product = f" x {cp}" if cp > 1 else ""
            raise ConfigError(
                f"world size {self.world_size} is not tensor-parallel ({tp}){cp_text} x pipeline-parallel ({pp}) "
                f"x data-parallel: {self.world_size} / ({tp}{cp_product} x {pp}) = "
                f"{self.world_size / (tp * cp * pp):g} is not a whole number. Launch a multiple of {tp * cp * pp} "
                f"processes, or change --tensor-model-parallel-size / --pipeline-model-parallel-size"
                f"{' / --context-parallel-size' if cp > 1 else ''}.")
        stage, expert_block = self.world_size // pp, self.etp * self.expert_model_parallel_size
        if stage % expert_block != 0:
            raise ConfigError(
                f"the {stage} ranks of a pipeline stage (tensor {tp} x context {cp} x data "
                f"{self.data_parallel_size}) do not split into expert-tensor ({self.etp}) x expert-model "
                f"({self.expert_model_parallel_size}) blocks: {stage} / {expert_block} is not a whole number. "
                f"Change --expert-model-parallel-size / --expert-tensor-parallel-size.")

    @property
    def etp(self) -> int:
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (self.pipeline_model_parallel_size * self.etp * self.expert_model_parallel_size)

    def _sizes(self) -> dict[str, int]:
        return {"tensor": self.tensor_model_parallel_size, "context": self.context_parallel_size,
                "data": self.data_parallel_size, "pipeline": self.pipeline_model_parallel_size,
                "expert_tensor": self.etp, "expert_model": self.expert_model_parallel_size,
                "expert_data": self.expert_data_parallel_size}

    def _rank_on(self, axes: tuple[str, ...], coordinates: dict[str, int]) -> int:
        rank, stride, sizes = 0, 1, self._sizes()
        for axis in axes:
            rank += coordinates[axis] * stride
            stride *= sizes[axis]
        return rank

    def rank(self, *, tensor: int, data: int, pipeline: int, context: int = 0) -> int:
        return self._rank_on(DENSE_AXES, {"tensor": tensor, "context": context, "data": data, "pipeline": pipeline})

    def coordinates(self, rank: int) -> dict:
        """rank -> its coordinates on both grids: {'tensor', 'context', 'data', 'pipeline', 'expert_*'}."""
        sizes, where = self._sizes(), {}
        for axes in (DENSE_AXES, EXPERT_AXES):
            rest = rank
            for axis in axes:
                rest, where[axis] = divmod(rest, sizes[axis])
        return where

    def groups_along(self, *varying: str) -> list[list[int]]:
        """Every group of ranks that differ only along the ``varying`` axes of one grid.

        Groups are listed with the fixed coordinates in rank order, members in rank order.
        """
        axes = EXPERT_AXES if any(axis.startswith("expert") for axis in varying) else DENSE_AXES
        sizes = self._sizes()
        fixed = [axis for axis in axes if axis not in varying]
        groups = []
        for fixed_values in itertools.product(*(range(sizes[a]) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_values))
            members = [self._rank_on(axes, {**base, **dict(zip(varying, values))})
                       for values in itertools.product(*(range(sizes[a]) for a in varying))]
            groups.append(sorted(members))
        return groups

    def tensor_model_parallel_groups(self) -> list[list[int]]:
        return self.groups_along("tensor")

    def data_parallel_groups(self) -> list[list[int]]:
        return self.groups_along("data")

    def pipeline_model_parallel_groups(self) -> list[list[int]]:
        return self.groups_along("pipeline")

    def model_parallel_groups(self) -> list[list[int]]:
        """All tensor and pipeline ranks that hold one replica of the model (and one sequence chunk)."""
        return self.groups_along("tensor", "pipeline")

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage: they share the tied word embeddings."""
        return [sorted({g[0], g[-1]}) for g in self.pipeline_model_parallel_groups()]

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group family. The context and expert families exist only when their sizes say so,
        so a dense, context-free run creates exactly the groups it always did."""
        groups = {"tensor": self.tensor_model_parallel_groups(), "data": self.data_parallel_groups(),
                  "pipeline": self.pipeline_model_parallel_groups(), "model": self.model_parallel_groups(),
                  "embedding": self.embedding_groups()}
        if self.context_parallel_size > 1:
            groups["context"] = self.groups_along("context")
            # Gradients of context-parallel replicas are reduced together with the data-parallel ones.
            groups["data_context"] = self.groups_along("context", "data")
        if self.expert_model_parallel_size > 1 or self.etp != self.tensor_model_parallel_size:
            groups["expert_tensor"] = self.groups_along("expert_tensor")
            groups["expert_model"] = self.groups_along("expert_model")
            groups["expert_data"] = self.groups_along("expert_data")
            # The ranks of one expert replica: their gradients are distinct pieces of the experts (the norm).
            groups["expert_tensor_model_pipeline"] = self.groups_along("expert_tensor", "expert_model", "pipeline")
        return groups


def _group_with(groups: list[list[int]], rank: int) -> list[int]:
    """The group holding ``rank``, or [] (a middle pipeline stage is in no embedding group)."""
    return next((g for g in groups if rank in g), [])


@dataclass
class ParallelState:
    """One rank's view of the parallel layout: its coordinates and its groups.

    A group of size one is ``None``: collectives on it are no-ops, which is what
    lets the single-process run share every code path with the parallel ones.
    """

    layout: RankLayout
    rank: int
    groups: dict = field(default_factory=dict)  # name -> ProcessGroup | MockGroup | None
    group_ranks: dict = field(default_factory=dict)  # name -> list of global ranks
    virtual_pipeline_model_parallel_size: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    # Sizes and ranks, with Megatron's names.
    @property
    def tensor_model_parallel_world_size(self) -> int:
        return self.layout.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_world_size(self) -> int:
        return self.layout.pipeline_model_parallel_size

    @property
    def data_parallel_world_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def context_parallel_world_size(self) -> int:
        return self.layout.context_parallel_size

    @property
    def expert_model_parallel_world_size(self) -> int:
        return self.layout.expert_model_parallel_size

    @property
    def expert_tensor_parallel_world_size(self) -> int:
        return self.layout.etp

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["tensor"]

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["pipeline"]

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["data"]

    @property
    def context_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["context"]

    @property
    def expert_model_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["expert_model"]

    @property
    def expert_tensor_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["expert_tensor"]

    @property
    def expert_data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["expert_data"]

    # Groups.
    @property
    def tensor_model_parallel_group(self):
        return self.groups["tensor"]

    @property
    def pipeline_model_parallel_group(self):
        return self.groups["pipeline"]

    @property
    def data_parallel_group(self):
        return self.groups["data"]

    @property
    def model_parallel_group(self):
        return self.groups["model"]

    @property
    def embedding_group(self):
        return self.groups["embedding"]

    # Families that exist only when their sizes are above one (``RankLayout.all_groups``); the
    # expert families fall back to the dense groups they coincide with when experts are not split.
    @property
    def context_parallel_group(self):
        return self.groups.get("context")

    @property
    def data_parallel_group_with_context(self):
        """Data x context ranks: the replicas whose gradients are reduced together."""
        return self.groups.get("data_context", self.groups["data"])

    @property
    def expert_model_parallel_group(self):
        return self.groups.get("expert_model")

    @property
    def expert_tensor_parallel_group(self):
        return self.groups.get("expert_tensor", self.groups["tensor"])

    @property
    def expert_data_parallel_group(self):
        return self.groups.get("expert_data", self.data_parallel_group_with_context)

    @property
    def splits_experts(self) -> bool:
        """Whether expert weights are split and replicated other than the dense ones (expert-model size
        above one, or an expert-tensor size other than the tensor size): they then have groups of their own."""
        return "expert_tensor_model_pipeline" in self.groups

    @property
    def expert_tensor_model_pipeline_group(self):
        """The ranks of one replica of every expert (tensor x pipeline when experts are not split)."""
        return self.groups.get("expert_tensor_model_pipeline", self.groups["model"])

    # Parameters: expert weights (``param.expert_parallel``) are split over the expert-tensor ranks and
    # replicated over the expert-data ones; every other parameter over the tensor and data ranks.
    def tensor_split(self, param) -> tuple[int, int]:
        """(rank, size) of the group ``param`` is split over along its ``partition_dim``."""
        if getattr(param, "expert_parallel", False):
            return self.expert_tensor_parallel_rank, self.expert_tensor_parallel_world_size
        return self.tensor_model_parallel_rank, self.tensor_model_parallel_world_size

    def replica_rank(self, param) -> int:
        """This rank's place among the replicas of ``param`` (0: the one that writes it to a checkpoint)."""
        if getattr(param, "expert_parallel", False):
            return self.expert_data_parallel_rank
        # Data x context ranks hold replicas of the dense weights (context ranks vary faster).
        return self.data_parallel_rank * self.context_parallel_world_size + self.context_parallel_rank

    # Pipeline neighbours.
    def is_pipeline_first_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == self.pipeline_model_parallel_world_size - 1

    @property
    def pipeline_next_rank(self) -> int:
        ranks = self.group_ranks["pipeline"]
        return ranks[(self.pipeline_model_parallel_rank + 1) % len(ranks)]

    @property
    def pipeline_prev_rank(self) -> int:
        ranks = self.group_ranks["pipeline"]
        return ranks[(self.pipeline_model_parallel_rank - 1) % len(ranks)]

    def is_in_embedding_group(self) -> bool:
        return self.rank in self.group_ranks["embedding"]


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None, *,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None,
                              rank: Optional[int] = None, world_size: Optional[int] = None,
                              new_group: Optional[Callable] = None,
                              distributed_timeout_minutes: float = 10) -> ParallelState:
    """Build this rank's groups.

    Every rank must create every group in the same order (``torch.distributed``'s
    rule), so all groups are created and only this rank's are kept. Each group's
    collectives time out after ``distributed_timeout_minutes`` (--distributed-timeout-minutes):
    a new group does not inherit the default group's timeout. Pass
    ``new_group=MockGroup``-style factories with explicit ``rank``/``world_size``
    to check a layout in one process without ``torch.distributed``.
    """
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
    layout = RankLayout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                        context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size)
    if new_group is None:
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
        new_group = functools.partial(_new_process_group, timeout=timeout) if world_size > 1 else (lambda ranks: None)
    state = ParallelState(layout=layout, rank=rank,
                          virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
    for name, groups in layout.all_groups().items():
        state.groups[name], state.group_ranks[name] = None, _group_with(groups, rank)
        for ranks in groups:
            group = new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = list(ranks)
                collectives.register_group_name(group, name)
    return state


def _new_process_group(ranks: list[int], timeout: datetime.timedelta):
    return dist.new_group(ranks=ranks, timeout=timeout)


def mock_parallel_state(rank: int, world_size: int, tensor_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, **expert_and_context_sizes) -> ParallelState:
    """One rank's state with ``MockGroup`` groups: bookkeeping checks, no processes.

    ``expert_and_context_sizes``: ``context_parallel_size``, ``expert_model_parallel_size``,
    ``expert_tensor_parallel_size``, as ``RankLayout`` takes them."""
    layout = RankLayout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                        **expert_and_context_sizes)
    state = ParallelState(layout=layout, rank=rank)
    for name, groups in layout.all_groups().items():
        ranks = _group_with(groups, rank)
        state.groups[name] = MockGroup(tuple(ranks), global_rank=rank) if len(ranks) > 1 else None
        state.group_ranks[name] = ranks
    return state


def destroy_model_parallel(state: ParallelState) -> None:
    """Release this rank's groups; the default group is the launcher's to destroy."""
    for group in set(g for g in state.groups.values() if g is not None and not isinstance(g, MockGroup)):
        dist.destroy_process_group(group)
    state.groups.clear()
    state.group_ranks.clear()
