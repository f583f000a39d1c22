"""apex's fused ops, imported in this one place.

Only ops whose semantics match the reference exactly are offered. apex's fused
softmax is not: it fills masked scores with -10000 (a fully masked row becomes
uniform, not zero) and only accepts some sequence lengths and dtypes.
"""
import functools
import importlib

import torch


@functools.lru_cache(maxsize=None)
def _import(module, name):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, OSError):
        return None


def layer_norm_op():
    """apex's LayerNorm as ``fn(x, weight, bias, eps)``, or None without apex."""
    fn = _import("apex.normalization.fused_layer_norm", "fused_layer_norm_affine")
    if fn is None:
        return None

    def layer_norm(x, weight, bias, eps):
        # apex's affine kernel reads weight and bias as x's dtype and needs a bias.
        bias = torch.zeros_like(weight) if bias is None else bias
        return fn(x, weight.to(x.dtype), bias.to(x.dtype), (x.shape[-1],), eps)

    return layer_norm


def rms_norm_op():
    """apex's RMSNorm as ``fn(x, weight, eps)``, or None without apex."""
    fn = _import("apex.normalization.fused_layer_norm", "fused_rms_norm_affine")
    if fn is None:
        return None

    def rms_norm(x, weight, eps):
        return fn(x, weight.to(x.dtype), (x.shape[-1],), eps)

    return rms_norm


def rotary_op():
    """apex's rotary embedding as ``fn(t, freqs)`` ([s, b, h, d] layout), or None."""
    fn = _import("apex.transformer.functional", "fused_apply_rotary_pos_emb")
    if fn is None:
        return None

    def apply_rotary_pos_emb(t, freqs):
        return fn(t, freqs.float())

    return apply_rotary_pos_emb
