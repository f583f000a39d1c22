"""One micro-batch's routing counts pooled over every mixture-of-experts layer of the model: the statistics of
``--moe-router-load-balancing-type pooled_aux_loss`` (transformers' load-balancing loss).

With E experts, L MoE layers, the micro-batch's T tokens, C_l the top-k assignments per expert of layer l and
P_l the sum of its tokens' scores per expert (docs/reference.md section 14):

    pooled aux loss = E / (L T)^2 * sum_e (sum_l C_le) (sum_l P_le) = sum_l E / (L T)^2 * sum_e Cbar_e P_le

C carries no gradient, so layer l's share of the loss is linear in its P_l with the coefficient
E / (L T)^2 * Cbar, and Cbar (the counts of every layer) is all a layer's gradient needs from the others.
It is complete only once the whole model has routed the micro-batch: on the last pipeline stage, whose
schedule sends each stage's running sum forward with the activations and the total back with the
gradients (``pipeline_parallel/schedules.py``), so every stage has it before that micro-batch's backward.

A router adds its layer to the pool of the micro-batch being run (``RoutingPool.add``) and attaches P_l to
its output with a gradient the pool supplies in backward; ``complete`` then also adds each layer's share of
the loss to its router's log (the shares of all layers sum to the loss).
"""
from __future__ import annotations

import torch

from megatron_lite.model.moe.router import BALANCING_LOSS_NAMES


class RoutingPool:
    """The pooled counts [E] of one micro-batch; ``received``: the sum of the layers of earlier pipeline stages."""

    def __init__(self, num_experts: int, num_moe_layers: int, received: torch.Tensor | None = None,
                 device: torch.device | None = None):
        self.num_moe_layers = num_moe_layers
        self.counts = (torch.zeros(num_experts, device=device) if received is None
                       else received.detach().clone().float())
        self.total: torch.Tensor | None = None
        self.num_tokens: int | None = None
        self._layers = []  # (router, this rank's P_l, detached)

    @property
    def partial(self) -> torch.Tensor:
        """The counts of this stage's layers and the ones before it: what the next stage continues from."""
        return self.counts

    def add(self, router, counts: torch.Tensor, scores_sum: torch.Tensor, *, num_tokens: int) -> None:
        """Layer ``router``'s counts C_l (over all the micro-batch's tokens) and this rank's P_l."""
        if self.total is not None:
            raise RuntimeError("a router routed a micro-batch whose pooled statistics are already complete.")
        self.counts = self.counts + counts
        self.num_tokens = num_tokens
        self._layers.append((router, scores_sum.detach()))

    def complete(self, total: torch.Tensor | None = None) -> None:
        """Every layer has routed: ``total`` (from the last stage), or this pool's counts on the last stage.
        Each layer's share of the loss joins its router's log."""
        self.total = self.counts if total is None else total.detach().float()
        for router, scores_sum in self._layers:
            router.log_loss(BALANCING_LOSS_NAMES["pooled_aux_loss"], (self.coefficient() * scores_sum).sum())

    def coefficient(self) -> torch.Tensor:
        """d(pooled loss) / d P_l, the same for every layer: E / (L T)^2 * Cbar [E]."""
        if self.total is None:
            raise RuntimeError("backward reached a router before its micro-batch's pooled routing statistics were "
                               "complete: the pipeline schedule completes them before each backward.")
        return self.total * (len(self.total) / (self.num_moe_layers * self.num_tokens) ** 2)
