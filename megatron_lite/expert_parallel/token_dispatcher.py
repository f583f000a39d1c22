"""The tokens of each expert to the rank that holds it, and the experts' outputs back (Megatron-Core's
all-to-all token dispatcher).

Experts are numbered globally and split into equal contiguous blocks, expert-model-parallel rank j
holding experts [j * E/ep, (j + 1) * E/ep). Every rank of the layer holds tokens no other rank
holds (``MoELayer`` makes sure of it), so a token goes to exactly one copy of each of its experts:

    dispatch  1. permute:    a row per (token, chosen expert), grouped by expert (token order within)
              2. all-to-all: over the expert-model group, each rank's rows to the rank of their expert;
                             rows arrive grouped by source rank, then by expert
              3. gather:     over the expert-tensor group, whose ranks hold shards of the same experts,
                             every peer's rows (each shard computes a partial output for all of them)
              4. sort:       rows grouped by local expert, for the experts to run block by block
    combine   the same steps backwards: unsort, reduce-scatter the partial outputs over the expert-tensor
              group, all-to-all back, then each row weighted by its routing probability and summed into
              its token

With ``probs_on_input`` (--moe-apply-probs-on-input, Llama 4) each row is weighted as it is permuted, before
the experts, and the outputs are summed as they come back.

Row counts are uneven everywhere (they are whatever the router chose), so each rank first tells the
others how many rows it sends per expert; the counts travel in one small all-to-all (and all-gather).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.expert_parallel.mappings import all_to_all, gather_rows, reduce_scatter_rows
from megatron_lite.process_groups import collectives


@dataclass
class DispatchPlan:
    """What ``combine`` needs to undo one ``dispatch``."""

    token_ids: torch.Tensor  # the token of each permuted row
    probs: torch.Tensor | None  # the routing probability of each permuted row (None: applied on the input)
    num_tokens: int
    input_splits: list[int]  # rows sent to each expert-model rank
    output_splits: list[int]  # rows received from each
    gathered_sizes: list[int]  # rows of each expert-tensor rank (after the all-to-all)
    order: torch.Tensor  # the permutation grouping the received rows by local expert


class AllToAllTokenDispatcher:
    """Dispatch and combine for ``num_experts`` experts split over ``ep_group`` (expert-model parallel),
    each split over ``etp_group`` (expert-tensor parallel); a group of None is one rank."""

    def __init__(self, num_experts: int, *, ep_group, etp_group, probs_on_input: bool = False):
        self.num_experts = num_experts
        self.probs_on_input = probs_on_input
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_size = collectives.world_size(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.ep_size} expert-parallel ranks.")
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """tokens [n, h]; probs and routing_map [n, experts] (the router's). Returns (the rows this rank's
        experts compute [rows, h], grouped by local expert; each local expert's row count; the plan)."""
        expert_ids, token_ids = routing_map.t().nonzero(as_tuple=True)  # expert-major, tokens in order
        rows = tokens.index_select(0, token_ids)
        row_probs = probs.t()[expert_ids, token_ids]
        if self.probs_on_input:
            rows = rows * row_probs.unsqueeze(-1).to(rows.dtype)
        counts = routing_map.sum(dim=0).long()  # rows per (global) expert
        received = self._exchange_counts(counts)  # [source rank, local expert]
        input_splits = counts.view(self.ep_size, self.num_local_experts).sum(dim=1).tolist()
        output_splits = received.sum(dim=1).tolist()
        rows = all_to_all(rows, self.ep_group, output_splits=output_splits, input_splits=input_splits)
        blocks = self._gather_counts(received)  # [source (expert-tensor rank, expert-model rank), local expert]
        gathered_sizes = blocks.view(collectives.world_size(self.etp_group), -1).sum(dim=1).tolist()
        rows = gather_rows(rows, gathered_sizes, self.etp_group, partial_grads=True)
        local_expert = torch.arange(self.num_local_experts, device=rows.device).repeat(blocks.shape[0])
        order = torch.repeat_interleave(local_expert, blocks.flatten().to(rows.device)).argsort(stable=True)
        plan = DispatchPlan(token_ids, None if self.probs_on_input else row_probs, tokens.shape[0], input_splits,
                            output_splits, gathered_sizes, order)
        return rows.index_select(0, order), blocks.sum(dim=0).tolist(), plan

    def combine(self, expert_output: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The experts' rows [rows, h] -> each token's probability-weighted sum of its experts' outputs [n, h]."""
        rows = expert_output.index_select(0, plan.order.argsort())
        rows = reduce_scatter_rows(rows, plan.gathered_sizes, self.etp_group)
        rows = all_to_all(rows, self.ep_group, output_splits=plan.input_splits, input_splits=plan.output_splits)
        if plan.probs is not None:
            rows = rows * plan.probs.unsqueeze(-1).to(rows.dtype)
        output = rows.new_zeros((plan.num_tokens, rows.shape[-1]))
        return output.index_add(0, plan.token_ids, rows)

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Rows per expert this rank sends -> rows per local expert it receives from each rank [ep, local]."""
        received = torch.empty_like(counts)
        collectives.all_to_all_single(received, counts, self.ep_group, output_split_sizes=[self.num_local_experts]
                                      * self.ep_size, input_split_sizes=[self.num_local_experts] * self.ep_size)
        return received.view(self.ep_size, self.num_local_experts)

    def _gather_counts(self, received: torch.Tensor) -> torch.Tensor:
        """Every expert-tensor peer's received counts, stacked in rank order [etp * ep, local]."""
        etp = collectives.world_size(self.etp_group)
        if etp == 1:
            return received
        gathered = received.new_empty((etp * self.ep_size, self.num_local_experts))
        collectives.all_gather_into_tensor(gathered, received.contiguous(), self.etp_group)
        return gathered
