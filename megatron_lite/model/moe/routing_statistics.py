"""Once per global batch: what the routers saw, summed over ranks; the expert bias it moves; the log line.

Each router counts the tokens it sent to each expert and sums its auxiliary losses over the
micro-batches of an iteration (``TopKRouter.forward``). The training step brackets an iteration:

    start_iteration(model_chunks, ...)        every router: clear the counts, and learn how this
                                              iteration's loss reaches the gradient (AuxLossScale)
    forward and backward of every micro-batch
    update_expert_bias(model_chunks, ps)      --moe-router-enable-expert-bias: the counts summed over the
                                              ranks that route the same layer's tokens, then
                                              bias_e += rate * sign(mean_count - count_e)

and the loop, for the log line, calls ``routing_summary``: every layer's counts and mean losses,
summed over all ranks (tensor, data and pipeline), the same on every rank. None of it does anything
in a model without experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.moe.router import BALANCING_LOSS_NAMES, LOSS_NAMES, AuxLossScale, TopKRouter
from megatron_lite.process_groups import collectives


def routers(model_chunks: list) -> dict[int, TopKRouter]:
    """The routers of this rank's chunks by global layer number (wrapped chunks or bare models); multi-token
    prediction's depth d (mtp.layers.{d}) is layer num_layers + d."""
    found = {}
    for chunk in model_chunks:
        model = getattr(chunk, "module", chunk)
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                number = int(name.split("layers.")[1].split(".")[0])
                found[number + (model.config.num_layers if name.startswith("mtp.") else 0)] = module
    return found


def start_iteration(model_chunks: list, scale: AuxLossScale) -> None:
    for router in routers(model_chunks).values():
        router.reset_statistics()
        router.aux_loss_scale = scale


@torch.no_grad()
def update_expert_bias(model_chunks: list, parallel_state) -> None:
    """The aux-loss-free balancing step (DeepSeek-V3): each expert's bias rises by the update rate if it got
    fewer tokens than the mean over experts in this global batch, falls if more, stays if equal."""
    # A frozen router (a PEFT run's base) keeps its bias, which belongs to the base checkpoint.
    biased = [r for r in routers(model_chunks).values()
              if r.expert_bias is not None and r.training and r.weight.requires_grad]
    if not biased:
        return
    counts = torch.stack([r.tokens_per_expert for r in biased])
    for group in _token_groups(parallel_state):
        collectives.all_reduce(counts, group)
    for router, count in zip(biased, counts):
        router.expert_bias += torch.sign(count.mean() - count) * router.bias_update_rate


POOLED_LOSS_NAME = BALANCING_LOSS_NAMES["pooled_aux_loss"]


@dataclass
class RoutingSummary:
    """One iteration's routing over the whole model: the mean over MoE layers of each auxiliary loss (the
    pooled one: its sum over the layers' shares), without its coefficient, averaged over micro-batches and
    data-parallel replicas, as Megatron-LM logs it; and the tokens each layer's experts received
    [moe layers, experts]."""

    losses: dict
    tokens_per_expert: torch.Tensor

    @property
    def load_imbalance(self) -> float:
        """The most loaded expert's tokens over the least loaded one's, in the worst layer (inf if one got none)."""
        most, least = self.tokens_per_expert.max(dim=1).values, self.tokens_per_expert.min(dim=1).values
        return float((most / least).max()) if bool((least > 0).all()) else float("inf")


def routing_summary(model_chunks: list, parallel_state, config: ModelConfig) -> RoutingSummary | None:
    """This iteration's ``RoutingSummary`` (a collective over every rank; None in a model without experts)."""
    if config.num_experts is None:
        return None
    names = LOSS_NAMES
    groups = _all_groups(parallel_state)
    # A row per layer: [this rank's share of each loss summed over micro-batches, micro-batches, counts...].
    table = torch.zeros(config.num_layers + (config.mtp_num_layers or 0), len(names) + 1 + config.num_experts,
                        device=collectives.reduction_device(groups))
    for layer, router in routers(model_chunks).items():
        table[layer, :len(names)] = torch.tensor([float(router.loss_sums[n]) for n in names])
        table[layer, len(names)] = router.microbatches
        table[layer, len(names) + 1:] = router.tokens_per_expert
    for group in groups:
        collectives.all_reduce(table, group)
    table = table[table[:, len(names)] > 0].cpu()  # the MoE layers that routed this iteration
    # Micro-batches were counted by every rank that routes tokens: the data-parallel ranks (and the
    # tensor- and context-parallel ones, which hold shares of each micro-batch's loss).
    sharing = parallel_state.tensor_model_parallel_world_size * parallel_state.context_parallel_world_size
    microbatches = table[:, len(names)].clamp(min=1) / sharing
    per_layer = table[:, :len(names)] / microbatches.unsqueeze(1)
    # The pooled loss is one loss of all layers, each holding its share; the others are each layer's own.
    losses = {name: float(per_layer[:, i].sum() if name == POOLED_LOSS_NAME else per_layer[:, i].mean())
              for i, name in enumerate(names)}
    return RoutingSummary(losses, table[:, len(names) + 1:])


def _token_groups(parallel_state) -> list:
    """The groups whose ranks route different tokens of the same layers: tensor and data(-with-context)."""
    return [parallel_state.tensor_model_parallel_group, parallel_state.data_parallel_group_with_context]


def _all_groups(parallel_state) -> list:
    return _token_groups(parallel_state) + [parallel_state.pipeline_model_parallel_group]
