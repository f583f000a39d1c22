"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

The full [s, b, vocab] logits never exist on one rank. Three all-reduces of
[s, b] tensors are enough (docs/reference.md section 4):

    m     = max over ranks of the local max            (all-reduce MAX, for stability)
    t     = the target's logit - m, from its owner      (all-reduce SUM; other ranks add 0)
    Z     = sum over ranks of sum(exp(logits - m))      (all-reduce SUM)
    loss  = log(Z) - t

The gradient is softmax - one-hot restricted to the local slice: no communication.

On one rank (tensor-parallel size 1) there is nothing to reduce, and the same loss is
log_softmax's, one fused pass over the logits: loss = -log_softmax(logits)[target]. Its
output is the only vocabulary-sized tensor the forward makes, and the backward turns it
into the gradient in place (exp gives the softmax), so a step allocates one such tensor
where the three-reduction form makes three (the logits are the largest activation of a
small model, and on a CPU every fresh allocation of that size costs page faults).
"""
from __future__ import annotations

import torch

from megatron_lite.process_groups import collectives


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group):
        # Softmax statistics in float32: exp/log of 16-bit logits would lose the loss's precision.
        input_dtype = vocab_parallel_logits.dtype
        vocab_parallel_logits = vocab_parallel_logits.float()
        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_start = collectives.rank(group) * partition_vocab_size

        logits_max = vocab_parallel_logits.max(dim=-1).values
        collectives.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        logits = vocab_parallel_logits - logits_max.unsqueeze(-1)

        # Only the owner of each target id reads its logit; the others contribute 0.
        not_owned = (target < vocab_start) | (target >= vocab_start + partition_vocab_size)
        local_target = (target - vocab_start).masked_fill(not_owned, 0)
        target_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_owned, 0.0)
        collectives.all_reduce(target_logits, group)

        exp_logits = logits.exp()
        sum_exp_logits = exp_logits.sum(dim=-1)
        collectives.all_reduce(sum_exp_logits, group)

        loss = sum_exp_logits.log() - target_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, not_owned)
        ctx.input_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_owned = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j == target], on this rank's slice of j.
        grad_input = softmax.clone()
        owned = (~not_owned).to(grad_input.dtype).unsqueeze(-1)
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -owned)
        grad_input.mul_(grad_loss.unsqueeze(-1))
        return grad_input.to(ctx.input_dtype), None, None


class _CrossEntropy(torch.autograd.Function):
    """The whole vocabulary on this rank: log_softmax, the target's entry, and softmax - one-hot back."""

    @staticmethod
    def forward(ctx, logits, target):
        # In float32 (a no-op for float32 logits), as the vocab-parallel path: the loss keeps its precision.
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        loss = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1).neg_()
        ctx.save_for_backward(log_probs, target)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved log-probabilities become the gradient in place; autograd's version check refuses a
        # second backward through them (retain_graph) instead of reading the overwritten buffer.
        log_probs, target = ctx.saved_tensors
        grad_loss = grad_loss.unsqueeze(-1)
        grad_input = log_probs.exp_().mul_(grad_loss)
        grad_input.scatter_add_(-1, target.unsqueeze(-1), -grad_loss)
        return grad_input.to(ctx.input_dtype), None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token cross entropy from vocab-sharded logits.

    Args:
        vocab_parallel_logits: [..., vocab / tp], this rank's slice of the vocabulary
            (rank r holds ids [r * vocab / tp, (r + 1) * vocab / tp)).
        target: [...] token ids in the full vocabulary.
        tp_group: Tensor-parallel group (None for one rank).

    Returns:
        [...] loss per token, identical on every tensor-parallel rank.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(vocab_parallel_logits.shape)} and target "
                         f"{tuple(target.shape)} must agree on every dimension but the last (vocabulary).")
    if collectives.world_size(tp_group) == 1:
        return _CrossEntropy.apply(vocab_parallel_logits, target)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)


@torch.no_grad()
def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token entropy -sum_j p_j log p_j of the softmax of vocab-sharded logits [..., vocab / tp], without a
    gradient (a logged statistic). With z the logits less their max over the ranks and Z = sum_j e^(z_j),
    H = log Z - sum_j e^(z_j) z_j / Z: the same max and two sums, all-reduced as the cross entropy's. Logits of
    -inf (padding rows of the vocabulary) contribute nothing."""
    logits = vocab_parallel_logits.float()
    logits_max = logits.max(dim=-1).values
    collectives.all_reduce(logits_max, tp_group, op=torch.distributed.ReduceOp.MAX)
    shifted = logits - logits_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    # Two vocabulary-sized tensors at a time (the logits are the largest activation): the product in place.
    sums = torch.stack([sum_exp, shifted.nan_to_num_(neginf=0.0).mul_(exp).sum(dim=-1)])
    collectives.all_reduce(sums, tp_group)
    return sums[0].log() - sums[1] / sums[0]
