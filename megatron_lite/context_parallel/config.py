"""What the attention layers are told about context parallelism, as one object (the counterpart of
``tensor_parallel.config.TensorParallelConfig``), made once by the model builder."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lite.process_groups import collectives


@dataclass(frozen=True)
class ContextParallelConfig:
    """``cp_group``: the ranks that split each sequence between them; ``global_ranks``: theirs, in group
    order (point-to-point messages name their peer by global rank); ``comm_types``: --cp-comm-type, one
    value for every layer or one per layer."""

    cp_group: Any
    global_ranks: tuple[int, ...]
    comm_types: tuple[str, ...] = ("p2p",)

    @property
    def size(self) -> int:
        return collectives.world_size(self.cp_group)

    @property
    def rank(self) -> int:
        return collectives.rank(self.cp_group)

    @classmethod
    def of_layout(cls, parallel_state, comm_types: tuple[str, ...] = ("p2p",)) -> "ContextParallelConfig | None":
        """The context-parallel group of ``parallel_state`` (a ParallelState), None without one."""
        if parallel_state is None or parallel_state.context_parallel_world_size == 1:
            return None
        return cls(cp_group=parallel_state.context_parallel_group,
                   global_ranks=tuple(parallel_state.group_ranks["context"]), comm_types=comm_types)

    def comm_type(self, layer_number: int) -> str:
        """How layer ``layer_number`` (global, 0-based) exchanges keys and values."""
        return self.comm_types[layer_number if len(self.comm_types) > 1 else 0]
