"""Straightforward float64 formulas for the fused ops, the oracle for kernel tests.

Written elementwise from the definitions, independently of ``reference.py``
(which uses torch's fused functional ops), so the two check each other.
"""
import math

import torch

# Norm-wise relative error allowed for outputs and gradients, by the tested dtype.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.norm()
    diff = (actual - expected).norm()
    return (diff / scale).item() if scale > 0 else diff.item()


def assert_close(actual, expected, dtype, name="", factor=1.0):
    """Asserts the relative error is within TOLERANCE[dtype] * factor."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    error = relative_error(actual, expected)
    assert error <= TOLERANCE[dtype] * factor, f"{name}: relative error {error:.3g} ({dtype})"


def layer_norm(x, weight, bias, eps):
    mean = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    y = (x - mean) / torch.sqrt(var + eps) * weight
    return y if bias is None else y + bias


def rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight


def gelu_tanh(y):
    return 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))


def bias_gelu(x, bias):
    return gelu_tanh(x if bias is None else x + bias)


def swiglu(x):
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    return gate / (1 + torch.exp(-gate)) * up


def rotary(t, freqs):
    """Rotates channel pairs (i, i + rot/2) by angle freqs[..., i] (cat(f, f) layout)."""
    rot = freqs.shape[-1]
    half = rot // 2
    out = t.clone()
    angle = freqs[..., :half]
    first, second = t[..., :half], t[..., half:rot]
    out[..., :half] = first * torch.cos(angle) - second * torch.sin(angle)
    out[..., half:rot] = second * torch.cos(angle) + first * torch.sin(angle)
    return out


def masked_softmax(x, mask, scale):
    """Softmax over the last dim of x * scale where mask is False; zeros where True."""
    keep = ~mask.expand_as(x)
    scores = x * scale
    row_max = torch.where(keep, scores, torch.full_like(scores, -math.inf)).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max) * keep
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def causal_mask(sq, sk):
    """True where key j lies after query i (queries aligned with the last sq keys)."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    return j > i + (sk - sq)
