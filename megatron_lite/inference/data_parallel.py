"""Generation's batches split over the data-parallel ranks, and their results put back in input order.

The prompts are cut into batches of ``--micro-batch-size`` as one process cuts them, and each
data-parallel rank takes a contiguous block of those batches. Each batch samples with a generator
of its own, seeded by ``--seed`` and the batch's index, so a batch draws the same tokens whichever
rank runs it: the responses are those of one process, token for token.

Under expert parallelism every data-parallel rank takes part in every step of every batch (the
experts' tokens are dispatched over them), so a rank with fewer batches runs fillers, whose tokens
are dropped, until every rank has run as many.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Batch:
    index: int  # among all batches, in input order
    start: int  # its prompts are prompts[start:end]
    end: int
    filler: bool = False  # run only to keep expert-parallel ranks in step; its results are dropped

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed + self.index)


def batches_of_rank(num_prompts: int, micro_batch_size: int, parallel_state) -> list[Batch]:
    """This data-parallel rank's batches (with fillers where its peers have more and experts are split)."""
    starts = range(0, num_prompts, micro_batch_size)
    batches = [Batch(i, start, min(start + micro_batch_size, num_prompts)) for i, start in enumerate(starts)]
    ranks = parallel_state.data_parallel_world_size if parallel_state is not None else 1
    rank = parallel_state.data_parallel_rank if parallel_state is not None else 0
    mine = batches[rank * len(batches) // ranks:(rank + 1) * len(batches) // ranks]
    if parallel_state is not None and parallel_state.splits_experts:
        most = -(-len(batches) // ranks)
        mine += [Batch(len(batches), 0, 1, filler=True)] * (most - len(mine))
    return mine


def gathered_in_order(results: list, parallel_state) -> list:
    """Every data-parallel rank's ``results`` (each in its batches' order), concatenated in rank order:
    the input order, since each rank's batches are a contiguous block."""
    group = parallel_state.data_parallel_group if parallel_state is not None else None
    if group is None:
        return results
    every = [None] * parallel_state.data_parallel_world_size
    dist.all_gather_object(every, results, group=group)
    return [result for rank_results in every for result in rank_results]
