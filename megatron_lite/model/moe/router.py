"""The router of a mixture-of-experts layer: which experts each token goes to, and with what weight.

All of it runs in fp32 whatever the model's precision (logits, scores, top-k, losses), as small
differences in the scores change which experts are chosen. Megatron-Core's ``TopKRouter``, flag for flag:

    scores    softmax: the top-k logits, then a softmax over them (the chosen weights sum to 1, Mixtral);
              with --moe-router-pre-softmax a softmax over all experts first, and the top-k of it kept
              as they are (OLMoE). sigmoid: each expert's sigmoid, the top-k normalised to sum to 1
              (DeepSeek-V3), chosen by sigmoid + --moe-router-enable-expert-bias's bias where it is on
    groups    --moe-router-num-groups G / --moe-router-group-topk g: a token first picks the g groups of
              E/G experts whose best k/g scores sum highest (or, --moe-router-group-score max, whose best
              score is highest: DeepSeek-V2), then its top-k among them
    scaling   --moe-router-topk-scaling-factor multiplies the chosen weights
    capacity  --moe-expert-capacity-factor f: each expert takes at most ceil(f * tokens * k / E) of this
              rank's tokens per micro-batch, keeping the most probable (or the earliest) and dropping the
              rest; --moe-pad-expert-input-to-capacity fills every expert to exactly that many

The losses (``aux_losses.py``) are computed on the router's own view of the scores, as Megatron-LM:
softmax over all experts (sigmoid normalised over all), with the plain top-k as the routing counted.
The pooled one (transformers') pools the counts of every layer of the micro-batch (``routing_pool.py``).

The tokens of one micro-batch may be split over ranks (``token_groups``: the tensor-parallel ranks,
whether sequence parallelism split them or ``MoELayer`` did, and the context-parallel ranks, each
with its chunks of every sequence): counts are summed over those groups, so every rank balances the
whole micro-batch's routing. The router weight's gradient is summed over the tensor-parallel ranks
(it is marked ``sequence_parallel`` for ``finalize_model_grads``); over the context-parallel ones
the data-parallel reduction averages it, which ``AuxLossScale`` makes up for.

Each router keeps this iteration's routing statistics (``routing_statistics.py`` reads them once per
global batch): the tokens each expert received, and the auxiliary losses it computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.moe.aux_losses import (attach_gradient, attach_loss, load_balancing_loss,
                                                sequence_load_balancing_loss, z_loss)
from megatron_lite.process_groups import collectives


# What the routers' losses are logged as (Megatron-LM's names), by --moe-router-load-balancing-type; the z-loss.
BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                        "pooled_aux_loss": "pooled_load_balancing_loss"}
LOSS_NAMES = (*BALANCING_LOSS_NAMES.values(), "z_loss")


@dataclass(frozen=True)
class TokenLayout:
    """Where this rank's tokens sit in the micro-batch: ``sequence_ids`` [tokens] the sequence of each,
    ``num_sequences`` and ``sequence_length`` the micro-batch's shape (whole sequences), ``token_groups`` the
    groups of ranks holding the rest of its tokens (none: this rank holds them all)."""

    sequence_ids: torch.Tensor
    num_sequences: int
    sequence_length: int
    token_groups: tuple = ()

    @property
    def num_tokens(self) -> int:
        return self.num_sequences * self.sequence_length


@dataclass(frozen=True)
class AuxLossScale:
    """How this iteration's language-model loss reaches the gradient, which the auxiliary losses follow:
    times ``loss_scale`` (fp16), and divided by ``num_microbatches``, or with a per-token loss by the
    global batch's token count (applied to every gradient in ``finalize_model_grads``; each micro-batch's
    losses are multiplied by its token count here to stay a mean over micro-batches).

    A micro-batch mean is also multiplied by ``context_parallel_size``: the data-parallel reduction averages
    over the context-parallel ranks, whose shares of the micro-batch's losses add up to them (a per-token
    loss's division already counts those ranks)."""

    loss_scale: float = 1.0
    num_microbatches: int = 1
    per_token: bool = False
    context_parallel_size: int = 1

    def of(self, num_tokens: int) -> float:
        if self.per_token:
            return self.loss_scale * num_tokens
        return self.loss_scale * self.context_parallel_size / self.num_microbatches


class TopKRouter(nn.Module):
    def __init__(self, config: ModelConfig, *, tensor_parallel_size: int, params_dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.num_groups, self.group_topk = config.moe_router_num_groups, config.moe_router_group_topk
        self.group_score = config.moe_router_group_score
        self.load_balancing_type = config.moe_router_load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        self.capacity_factor = config.moe_expert_capacity_factor
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        self.drop_policy = config.moe_token_drop_policy
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=params_dtype))
        # With --add-bias-linear (gpt-oss) the logits have a bias too: Megatron-Core's router.bias.
        self.bias = None
        if config.add_bias_linear:
            self.bias = nn.Parameter(torch.empty(self.num_experts, dtype=params_dtype))
        # MoELayer hands each tensor-parallel rank different tokens: their gradients are partial sums.
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel = tensor_parallel_size > 1
        self.bias_update_rate = config.moe_router_bias_update_rate
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.aux_loss_scale = AuxLossScale()  # set for each iteration by routing_statistics.start_iteration
        self.pool = None  # pooled_aux_loss: the RoutingPool of the micro-batch being run, set by the model
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=False)
        self.reset_statistics()

    def reset_statistics(self) -> None:
        """Start an iteration's statistics: tokens per expert, loss sums and the micro-batches they cover."""
        self.tokens_per_expert.zero_()
        self.loss_sums = dict.fromkeys(LOSS_NAMES, 0.0)
        self.microbatches = 0

    def forward(self, tokens: torch.Tensor, layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [n, h] -> (probs [n, E] fp32, zero where not routed; routing_map [n, E] bool)."""
        logits = F.linear(tokens.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        training = self.training and torch.is_grad_enabled()  # not in evaluation, nor a recomputation's first pass
        if training and self.z_loss_coeff:
            logits = self._attach(logits, "z_loss", z_loss(logits, num_tokens=layout.num_tokens), self.z_loss_coeff,
                                  layout)
        probs, routing_map = self._top_k(logits)
        if training and self.load_balancing_type == "pooled_aux_loss" and self.aux_loss_coeff > 0:
            probs = self._attach_pooled(probs, logits, layout)
        elif training and self.load_balancing_type != "none" and self.aux_loss_coeff > 0:
            probs = self._attach(probs, BALANCING_LOSS_NAMES[self.load_balancing_type],
                                 self._balancing_loss(logits, layout), self.aux_loss_coeff, layout)
        if self.capacity_factor is not None:
            probs, routing_map = self._drop_past_capacity(probs, routing_map)
        if training:
            self.tokens_per_expert += routing_map.sum(dim=0).float()
            self.microbatches += 1
        return probs, routing_map

    def log_loss(self, name: str, value: torch.Tensor) -> None:
        self.loss_sums[name] += value.detach()  # logged without its coefficient, as Megatron-LM

    def _attach(self, activation: torch.Tensor, name: str, loss: torch.Tensor, coeff: float,
                layout: TokenLayout) -> torch.Tensor:
        self.log_loss(name, loss)
        return attach_loss(activation, coeff * loss, self.aux_loss_scale.of(layout.num_tokens))

    def _attach_pooled(self, probs: torch.Tensor, logits: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """This layer's counts join the micro-batch's pool; its score sums get the pooled loss's gradient, which
        the pool knows once every layer has routed (``routing_pool.py``)."""
        if self.pool is None:
            raise RuntimeError("a pooled_aux_loss router trained outside a micro-batch: the model sets its pool "
                               "(GPTModel.begin_microbatch, called by the pipeline schedule).")
        pool, scores = self.pool, self._balancing_scores(logits)
        counts = _summed(self._routed(scores).sum(dim=0), layout.token_groups)
        pool.add(self, counts, scores.sum(dim=0), num_tokens=layout.num_tokens)
        scale = self.aux_loss_coeff * self.aux_loss_scale.of(layout.num_tokens)
        return attach_gradient(probs, scores.sum(dim=0), lambda: pool.coefficient() * scale)

    # Routing.
    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            indices = self._choose(choice)
            weights = scores.gather(1, indices)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) if self.topk > 1 else weights
        elif self.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            indices = self._choose(scores)
            weights = scores.gather(1, indices)
        else:
            indices = self._choose(logits)
            weights = torch.softmax(logits.gather(1, indices), dim=-1)
        if self.scaling_factor:
            weights = weights * self.scaling_factor
        probs = torch.zeros_like(logits).scatter(1, indices, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return probs, routing_map

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The top-k experts of each token [n, k], within its best groups under group-limited routing."""
        if self.num_groups is None:
            return scores.topk(self.topk, dim=-1).indices
        tokens = scores.shape[0]
        grouped = scores.view(tokens, self.num_groups, self.num_experts // self.num_groups)  # tokens may be 0
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(self.topk // self.group_topk, dim=-1).values.sum(dim=-1)
        chosen_groups = group_scores.topk(self.group_topk, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
        allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(tokens, self.num_experts)
        return scores.masked_fill(~allowed, float("-inf")).topk(self.topk, dim=-1).indices

    def _drop_past_capacity(self, probs: torch.Tensor, routing_map: torch.Tensor):
        """Keep at most ``capacity`` tokens per expert (exactly that many with padding)."""
        tokens = probs.shape[0]
        capacity = math.ceil(tokens * self.topk / self.num_experts * self.capacity_factor)
        if capacity >= tokens:
            keep = torch.ones_like(routing_map) if self.pad_to_capacity else routing_map
            return probs * keep, keep
        if self.drop_policy == "probs":
            priority = probs.detach()
        else:  # "position": routed tokens first, each group in order
            position = torch.arange(tokens, 0, -1, device=probs.device, dtype=torch.float32).unsqueeze(-1)
            priority = routing_map * (2 * tokens) + position
        capacity_mask = torch.zeros_like(routing_map).scatter(0, priority.topk(capacity, dim=0).indices, True)
        keep = capacity_mask if self.pad_to_capacity else capacity_mask & routing_map
        return probs * keep, keep

    # Losses.
    def _balancing_scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.score_function == "softmax":
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def _routed(self, scores: torch.Tensor) -> torch.Tensor:
        """1 where the plain top-k of ``scores`` routes a token: what the balancing losses count."""
        return torch.zeros_like(scores).scatter(1, scores.topk(self.topk, dim=-1).indices, 1.0)

    def _balancing_loss(self, logits: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        scores = self._balancing_scores(logits)
        routed = self._routed(scores)
        if self.load_balancing_type == "aux_loss":
            counts = _summed(routed.sum(dim=0), layout.token_groups)
            return load_balancing_loss(scores, counts, num_tokens=layout.num_tokens, topk=self.topk)
        counts = routed.new_zeros((layout.num_sequences, self.num_experts)).index_add(0, layout.sequence_ids, routed)
        return sequence_load_balancing_loss(scores, _summed(counts, layout.token_groups), layout.sequence_ids,
                                            sequence_length=layout.sequence_length, topk=self.topk)


def _summed(counts: torch.Tensor, groups: tuple) -> torch.Tensor:
    """``counts`` summed over the ranks that hold the micro-batch's other tokens."""
    counts = counts.detach().clone()
    for group in groups:
        collectives.all_reduce(counts, group)
    return counts
