"""Attention of a block of queries over one block of keys: its output and log-sum-exp, and its backward.

Attention over keys cut into blocks can be computed block by block and merged (docs/reference.md
section 15). Per query row, with s the softmax scale,

    o_j = softmax(s q K_j^T) V_j,   l_j = log sum exp(s q K_j^T)         one block
    l = log(exp(l_1) + exp(l_2) + ...),   o = sum_j exp(l_j - l) o_j      the whole (``merge``)

The backward needs nothing per block but the block's own keys and values: from the final (o, l) and dO,
the block's probabilities are P_j = exp(s q K_j^T - l), and with D = rowsum(dO * o)

    dV_j = P_j^T dO,   dS_j = P_j * (dO V_j^T - D),   dq += s dS_j K_j,   dK_j = s dS_j^T q

(the flash-attention backward), so a ring of key blocks can pass by twice without any block's
probabilities being kept in between.

Attention sinks (a logit per head in the softmax's denominator whose value is zero, ``model/attention_sinks.py``)
join the merge once, as one more block of log-sum-exp ``sink_h`` and output zero: after the blocks' merge,

    l' = log(exp(l) + exp(sink_h)),   o' = o exp(l - l')                  (``add_sink``)

and the backward above runs unchanged from (o', l'); the sink's own gradient is that of its probability column,
dsink_h = -sum over rows of exp(sink_h - l') rowsum(dO * o') (``sink_gradient``).

Two kernels compute a block, chosen as ``--attention-backend`` chooses for the whole sequence:
``ExplicitBlockAttention`` writes the formulas out (unfused/local, and attention soft-capping, which acts
between QK^T and the softmax); ``FlashBlockAttention`` runs the flash kernel torch's
scaled_dot_product_attention runs on the CPU, which returns the log-sum-exp and whose backward takes the
final (o, l). On other devices it falls back to the explicit formulas: their SDPA kernels return the
log-sum-exp through device-specific entry points no test here can run. It falls back too when values are
narrower than keys (multi-latent attention), which the CPU kernel does not take (SDPA itself then takes
its math path).

Blocks are [b, heads, s, d]; grouped-query keys and values carry fewer heads and are repeated for the
kernel, their gradients summed back. A mask is ``CAUSAL`` (a diagonal block: query i sees keys 0..i), None
(every key), or bool broadcastable to [b, heads, sq, sk], True = may not attend. A query row that sees no
key of a block gets l = -inf and o = 0, which ``merge`` weighs 0.
"""
from __future__ import annotations

import torch

CAUSAL = "causal"


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """(out, lse) of the keys of both: the log-sum-exp rule. Rows where both are -inf stay (0, -inf)."""
    merged = torch.logaddexp(lse, block_lse)
    old_weight = torch.exp(lse - merged).nan_to_num_(0.0)  # exp(-inf - -inf) is nan: such a row has no weight
    new_weight = torch.exp(block_lse - merged).nan_to_num_(0.0)
    return out * old_weight[..., None] + block_out.float() * new_weight[..., None], merged


def add_sink(out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor):
    """(o', l') of merged blocks (o [b, heads, s, dv], l [b, heads, s]) with each head's sink ``offset`` [heads]."""
    merged = torch.logaddexp(lse, offset.float().view(1, -1, 1))
    return out * torch.exp(lse - merged)[..., None], merged


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """d loss / d offset [heads] from dO and the final (o', l') ([b, heads, s, dv] and [b, heads, s])."""
    sink_probability = torch.exp(offset.float().view(1, -1, 1) - lse)
    return -(sink_probability * (grad_out.float() * out.float()).sum(dim=-1)).sum(dim=(0, 2))


def causal_mask(query_length: int, key_length: int, device) -> torch.Tensor:
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).triu(1)


def _repeat_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    return tensor if tensor.shape[1] == heads else tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _sum_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of a repeated [b, groups, s, d] tensor from that of its [b, heads, s, d] repetition."""
    batch, heads, length, dim = grad.shape
    return grad if heads == groups else grad.view(batch, groups, heads // groups, length, dim).sum(2)


class ExplicitBlockAttention:
    """The block formulas written out, in fp32; ``logit_capping`` (soft_capping.py) caps the scaled scores."""

    def __init__(self, scale: float, logit_capping=None):
        self.scale = scale
        self.logit_capping = logit_capping

    def _scores(self, query, key, mask):
        """(capped scores, the same masked with -inf) of fp32 [b, heads, sq, d] query and key."""
        scores = torch.matmul(query, key.transpose(-1, -2)) * self.scale
        if self.logit_capping is not None:
            scores = self.logit_capping(scores)
        if mask is CAUSAL:
            mask = causal_mask(query.shape[2], key.shape[2], query.device)
        return scores, scores if mask is None else scores.masked_fill(mask, float("-inf"))

    def forward(self, query, key, value, mask):
        heads = query.shape[1]
        key, value = _repeat_heads(key.float(), heads), _repeat_heads(value.float(), heads)
        _, scores = self._scores(query.float(), key, mask)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
        return torch.matmul(probs, value), lse

    def backward(self, grad_out, query, key, value, out, lse, mask):
        groups, heads = key.shape[1], query.shape[1]
        query, grad_out, out = query.float(), grad_out.float(), out.float()
        key, value = _repeat_heads(key.float(), heads), _repeat_heads(value.float(), heads)
        capped, scores = self._scores(query, key, mask)
        probs = torch.exp(scores - lse[..., None])
        grad_value = torch.matmul(probs.transpose(-1, -2), grad_out)
        grad_scores = probs * (torch.matmul(grad_out, value.transpose(-1, -2))
                               - (grad_out * out).sum(dim=-1, keepdim=True))
        if self.logit_capping is not None:  # d/dx cap tanh(x / cap) = 1 - tanh^2 (masked entries are 0 already)
            grad_scores = grad_scores * (1 - (capped / self.logit_capping.cap) ** 2)
        grad_query = torch.matmul(grad_scores, key) * self.scale
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query) * self.scale
        return grad_query, _sum_heads(grad_key, groups), _sum_heads(grad_value, groups)


class FlashBlockAttention:
    """torch's CPU flash-attention kernel (what scaled_dot_product_attention runs on the CPU)."""

    def __init__(self, scale: float):
        self.scale = scale
        self.explicit = ExplicitBlockAttention(scale)

    def _additive(self, query, mask):
        """(is_causal, additive float mask or None): the kernel takes a mask in the query's dtype."""
        if mask is None or mask is CAUSAL:
            return mask is CAUSAL, None
        return False, torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(mask, float("-inf"))

    def _runs(self, query, key, value) -> bool:
        return query.is_cpu and key.shape[-1] == value.shape[-1]

    def forward(self, query, key, value, mask):
        if not self._runs(query, key, value):
            return self.explicit.forward(query, key, value, mask)
        heads = query.shape[1]
        is_causal, additive = self._additive(query, mask)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.contiguous(), _repeat_heads(key, heads).contiguous(), _repeat_heads(value, heads).contiguous(),
            0.0, is_causal, attn_mask=additive,
            scale=self.scale)
        if additive is not None:  # the kernel reports 0 for a row with no key to see; the merge needs -inf
            lse = lse.masked_fill(mask.all(dim=-1).expand_as(lse), float("-inf"))
        return out, lse

    def backward(self, grad_out, query, key, value, out, lse, mask):
        if not self._runs(query, key, value):
            return self.explicit.backward(grad_out, query, key, value, out, lse, mask)
        groups, heads = key.shape[1], query.shape[1]
        is_causal, additive = self._additive(query, mask)
        grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(query.dtype).contiguous(), query.contiguous(), _repeat_heads(key, heads).contiguous(),
            _repeat_heads(value, heads).contiguous(), out.to(query.dtype).contiguous(), lse.contiguous(), 0.0,
            is_causal, attn_mask=additive, scale=self.scale)
        return grad_query, _sum_heads(grad_key, groups), _sum_heads(grad_value, groups)
