"""The batches of a command that reads a checkpoint (generation, evaluation) split over the data-parallel ranks,
and their results put back in input order.

Batch i goes to data-parallel rank i mod d, so a rank streams through the input and needs no count of it
first. Under expert parallelism every data-parallel rank takes part in every forward pass (the experts'
tokens are dispatched over them), so a rank that runs out of batches before the first rank runs fillers
(the input's last batch again, a batch of the right kind), whose results are dropped, until it has run
as many.
"""
from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def share_of_rank(batches: Iterable[T], parallel_state) -> Iterator[tuple[int | None, T]]:
    """(index, batch) of this data-parallel rank's batches, then (None, a filler) while experts need one."""
    ranks = parallel_state.data_parallel_world_size if parallel_state is not None else 1
    rank = parallel_state.data_parallel_rank if parallel_state is not None else 0
    mine = total = 0
    last = None
    for index, batch in enumerate(batches):
        total, last = total + 1, batch
        if index % ranks == rank:
            mine += 1
            yield index, batch
    if parallel_state is not None and parallel_state.splits_experts:
        for _ in range(-(-total // ranks) - mine):  # rank 0 runs the most: ceil(total / ranks)
            yield None, last


def gathered_in_order(indexed_results: list[tuple[int, list]], parallel_state) -> list:
    """Every data-parallel rank's (batch index, results of that batch), as one list in input order."""
    group = parallel_state.data_parallel_group if parallel_state is not None else None
    every = [indexed_results]
    if group is not None:
        every = [None] * parallel_state.data_parallel_world_size
        dist.all_gather_object(every, indexed_results, group=group)
    return [result for _, results in sorted(pair for rank in every for pair in rank) for result in results]
