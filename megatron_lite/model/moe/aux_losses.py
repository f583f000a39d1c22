"""The router's auxiliary losses, and how their gradient joins the backward pass.

With E experts, top-k routing and the T tokens of a micro-batch (docs/reference.md section 14):

    aux_loss      E / (k T^2) * sum_e C_e P_e                 Switch Transformer's load balancing, as
                                                              Megatron-LM: C_e tokens routed to expert e,
                                                              P_e the sum of their scores for e
    seq_aux_loss  mean over sequences of the same, with T,    DeepSeek's per-sequence balance
                  C and P of each sequence
    z_loss        mean over tokens of logsumexp(logits)^2     ST-MoE's bound on the router logits
    pooled_       E / (L T)^2 * sum_e Cbar_e Pbar_e: C and P  transformers' (Switch Transformer's, all
    aux_loss      summed over the L MoE layers                layers at once), routing_pool.py

C is a count (no gradient), so each loss is linear in P: a rank holding some of the micro-batch's
tokens adds its share of P times the micro-batch's C (summed over the ranks that split the tokens),
and the shares of the ranks add up to the loss.

A loss of a layer that is not on the last pipeline stage cannot be added to the training loss, so
it is attached to an activation instead (Megatron-Core's ``MoEAuxLossAutoScaler``): the activation
passes unchanged, and when its gradient comes back the loss gets the gradient ``scale`` (what the
language-model loss gets: the fp16 loss scale, divided by the micro-batches of the step).
"""
from __future__ import annotations

import torch


class _AttachGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, tensor, gradient):
        ctx.gradient = gradient
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.gradient(), None


def attach_gradient(activation: torch.Tensor, tensor: torch.Tensor, gradient) -> torch.Tensor:
    """``activation`` unchanged; its backward also runs ``tensor``'s with the gradient ``gradient()``, asked for
    only then (the pooled load-balancing loss's is known once the whole model has routed, ``routing_pool.py``)."""
    return _AttachGradient.apply(activation, tensor, gradient)


def attach_loss(activation: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``activation`` unchanged; its backward also runs ``loss``'s with the gradient ``scale``."""
    return attach_gradient(activation, loss, lambda: torch.full_like(loss, scale))


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, *, num_tokens: int, topk: int) -> torch.Tensor:
    """E / (k T^2) * sum_e C_e P_e: ``scores`` [tokens, E] of this rank's tokens, ``counts`` [E] (C, over all
    ``num_tokens`` = T tokens of the micro-batch)."""
    num_experts = scores.shape[-1]
    return (scores.sum(dim=0) * counts).sum() * (num_experts / (topk * num_tokens * num_tokens))


def sequence_load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, sequence_ids: torch.Tensor, *,
                                 sequence_length: int, topk: int) -> torch.Tensor:
    """The mean over sequences of each one's ``load_balancing_loss``; ``counts`` [sequences, E] (over whole
    sequences), ``sequence_ids`` [tokens]: the sequence of each of this rank's tokens."""
    num_sequences, num_experts = counts.shape
    per_sequence = scores.new_zeros((num_sequences, num_experts)).index_add(0, sequence_ids, scores)
    scale = num_experts / (topk * sequence_length * sequence_length * num_sequences)
    return (per_sequence * counts).sum() * scale


def z_loss(logits: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """This rank's share of the mean over the micro-batch's ``num_tokens`` of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().sum() / num_tokens
