"""Pure-PyTorch reference implementations of the fused ops.

These define the semantics every faster path (our CUDA extension, apex) is tested
against. They are written as plain tensor math so ``torch.compile`` can fuse them,
and they accumulate in float32 and return the input's dtype, as the CUDA kernels do.
"""
import torch
import torch.nn.functional as F


def _as(t, dtype):
    """``t`` in ``dtype``; one already in it (None too) is returned as it is, without the call ``.to`` costs
    even when it copies nothing: a decoding step makes thousands of them."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def layer_norm(x, weight, bias, eps):
    """LayerNorm over the last dimension, computed in float32.

    Args:
        x: input of any shape [..., hidden].
        weight: scale [hidden].
        bias: shift [hidden], or None.
        eps: added to the variance.

    Returns:
        Tensor shaped and typed like ``x``.
    """
    y = F.layer_norm(_as(x, torch.float32), (x.shape[-1],), _as(weight, torch.float32), _as(bias, torch.float32),
                     eps)
    return _as(y, x.dtype)


def rms_norm(x, weight, eps):
    """RMSNorm (Llama): ``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32.

    The weight multiply also happens in float32 (HF Llama rounds to the input dtype
    first); that matches the fused kernel and is the more accurate of the two.
    """
    xf = _as(x, torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _as(y * _as(weight, torch.float32), x.dtype)


def bias_gelu(x, bias):
    """GELU (tanh approximation, GPT-2's ``gelu_new``) of ``x + bias``; ``bias`` may be None.

    The bias is added in x's dtype, so the result keeps x's dtype.
    """
    if bias is not None:
        x = x + _as(bias, x.dtype)
    return F.gelu(x, approximate="tanh")


def swiglu(x):
    """SwiGLU activation: the last dim of ``x`` holds [gate, up]; returns ``silu(gate) * up``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def bias_dropout_add(x, bias, residual, prob, training):
    """``residual + dropout(x + bias)``; ``bias`` (may be None) is added in x's dtype."""
    if bias is not None:
        x = x + _as(bias, x.dtype)
    if training or not 0.0 <= prob <= 1.0:  # else F.dropout is the identity (it checks the probability)
        x = F.dropout(x, p=prob, training=training)
    return residual + x


def rotate_half(t):
    """Maps the halves [t1, t2] of the last dim to [-t2, t1]."""
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    """Rotary position embedding, rotate-half convention (Megatron, HF Llama).

    Args:
        t: [seq, batch, heads, head_dim] queries or keys.
        freqs: [seq, 1, 1, rot_dim] float angles laid out as cat(f, f). When
            ``rot_dim < head_dim`` only the first ``rot_dim`` channels rotate
            (partial rotary); the rest pass through.

    Returns:
        ``t * cos + rotate_half(t) * sin``, computed in float32, in t's dtype.
    """
    rot_dim = freqs.shape[-1]
    if rot_dim > t.shape[-1] or rot_dim % 2:
        raise ValueError(
            f"rotary dim {rot_dim} must be even and at most head_dim {t.shape[-1]}; the model builds it as "
            "--hidden-size / --num-attention-heads"
        )
    freqs = _as(freqs, torch.float32)
    t_rot, t_pass = _as(t[..., :rot_dim], torch.float32), t[..., rot_dim:]
    out = _as(t_rot * torch.cos(freqs) + rotate_half(t_rot) * torch.sin(freqs), t.dtype)
    if rot_dim == t.shape[-1]:  # every channel rotates: nothing to join back (a cat would copy it all)
        return out
    return torch.cat((out, t_pass), dim=-1)


def causal_mask(sq, sk, device):
    """Bool [sq, sk], True where key j is in the future of query i.

    Queries are aligned with the last ``sq`` keys (``j > i + sk - sq``), which is the
    usual square mask when sq == sk and the right one when earlier keys are cached.
    """
    if sk < sq:
        raise ValueError(f"causal softmax needs at least as many keys ({sk}) as queries ({sq})")
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def scaled_upper_triang_masked_softmax(x, scale):
    """Causal softmax of ``x * scale`` over the last dim; x is [batch * heads, sq, sk]."""
    mask = causal_mask(x.shape[-2], x.shape[-1], x.device)
    return scaled_masked_softmax(x, mask, scale)


def scaled_masked_softmax(x, mask, scale):
    """Softmax of ``x * scale`` over the last dim, with masked positions excluded.

    Args:
        x: scores [batch, heads, sq, sk] (any shape that ``mask`` broadcasts to).
        mask: bool, True = masked, broadcastable to ``x`` (e.g. [batch, 1, sq, sk]),
            or None for a plain scaled softmax.
        scale: multiplies the scores before the softmax.

    Returns:
        Probabilities in x's dtype; masked positions and fully masked rows are zero
        (Megatron's -10000 fill would spread a fully masked row uniformly instead).
    """
    scores = x.float() * scale
    if mask is None:
        return torch.softmax(scores, dim=-1).to(x.dtype)
    # A finite fill keeps fully masked rows NaN-free (uniform); zeroing the masked
    # positions afterwards turns those rows into zeros, in value and in gradient.
    scores = scores.masked_fill(mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
    return probs.to(x.dtype)
