"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

The full [s, b, vocab] logits never exist on one rank. Three all-reduces of
[s, b] tensors are enough (docs/reference.md section 4):

    m     = max over ranks of the local max            (all-reduce MAX, for stability)
    t     = the target's logit - m, from its owner      (all-reduce SUM; other ranks add 0)
    Z     = sum over ranks of sum(exp(logits - m))      (all-reduce SUM)
    loss  = log(Z) - t

The gradient is softmax - one-hot restricted to the local slice: no communication.
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
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
