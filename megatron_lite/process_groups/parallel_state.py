"""Process groups for tensor, pipeline and data parallelism.

The world is a grid of shape (pipeline, data, tensor) laid out in rank order with
tensor-parallel ranks adjacent (they talk the most, so they share a node), then
data-parallel, then pipeline:

    rank = pipeline_rank * (data * tensor) + data_rank * tensor + tensor_rank

``RankLayout`` computes every group as plain lists of ranks, without any process
group, so a 1,024-rank layout can be checked in milliseconds. ``ParallelState``
holds one rank's groups and is passed explicitly to every module that talks.
"""
from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.collectives import MockGroup
from megatron_lite.config import ConfigError


@dataclass(frozen=True)
class RankLayout:
    """Pure arithmetic of the (pipeline, data, tensor) rank grid."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if tp < 1 or pp < 1 or self.world_size < 1:
            raise ConfigError(
                f"world size ({self.world_size}), --tensor-model-parallel-size ({tp}) and "
                f"--pipeline-model-parallel-size ({pp}) must all be at least 1.")
        if self.world_size % (tp * pp) != 0:
            raise ConfigError(
                f"world size {self.world_size} is not tensor-parallel ({tp}) x pipeline-parallel ({pp}) "
                f"x data-parallel: {self.world_size} / ({tp} x {pp}) = {self.world_size / (tp * pp):g} is not "
                f"a whole number. Launch a multiple of {tp * pp} processes, or change "
                f"--tensor-model-parallel-size / --pipeline-model-parallel-size.")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def rank(self, *, tensor: int, data: int, pipeline: int) -> int:
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return pipeline * dp * tp + data * tp + tensor

    def coordinates(self, rank: int) -> dict:
        """rank -> {'tensor', 'data', 'pipeline'} coordinates."""
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return {"tensor": rank % tp, "data": (rank // tp) % dp, "pipeline": rank // (tp * dp)}

    def _groups_along(self, axis: str) -> list[list[int]]:
        sizes = {"tensor": self.tensor_model_parallel_size, "data": self.data_parallel_size,
                 "pipeline": self.pipeline_model_parallel_size}
        others = [a for a in ("pipeline", "data", "tensor") if a != axis]
        groups = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                fixed = {others[0]: i, others[1]: j}
                groups.append([self.rank(**fixed, **{axis: k}) for k in range(sizes[axis])])
        return groups

    def tensor_model_parallel_groups(self) -> list[list[int]]:
        return self._groups_along("tensor")

    def data_parallel_groups(self) -> list[list[int]]:
        return self._groups_along("data")

    def pipeline_model_parallel_groups(self) -> list[list[int]]:
        return self._groups_along("pipeline")

    def model_parallel_groups(self) -> list[list[int]]:
        """All tensor and pipeline ranks that hold one replica of the model."""
        return [[self.rank(tensor=t, data=d, pipeline=p)
                 for p in range(self.pipeline_model_parallel_size)
                 for t in range(self.tensor_model_parallel_size)]
                for d in range(self.data_parallel_size)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage: they share the tied word embeddings."""
        return [sorted({g[0], g[-1]}) for g in self.pipeline_model_parallel_groups()]

    def all_groups(self) -> dict[str, list[list[int]]]:
        return {"tensor": self.tensor_model_parallel_groups(), "data": self.data_parallel_groups(),
                "pipeline": self.pipeline_model_parallel_groups(), "model": self.model_parallel_groups(),
                "embedding": self.embedding_groups()}


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
    def tensor_model_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["tensor"]

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["pipeline"]

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank)["data"]

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
                              rank: Optional[int] = None, world_size: Optional[int] = None,
                              new_group: Optional[Callable] = None,
                              distributed_timeout_minutes: int = 10) -> ParallelState:
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
    layout = RankLayout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size)
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
                        pipeline_model_parallel_size: int = 1) -> ParallelState:
    """One rank's state with ``MockGroup`` groups: bookkeeping checks, no processes."""
    layout = RankLayout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size)
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
