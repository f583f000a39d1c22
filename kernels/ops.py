"""The fused ops the model calls, each with one dispatch rule (see ``dispatch.py``)."""
from . import apex_ops, fused, reference
from .dispatch import choose, configure, fused_enabled

__all__ = [
    "configure",
    "fused_enabled",
    "load_extension",
    "layer_norm",
    "rms_norm",
    "bias_gelu",
    "swiglu",
    "bias_dropout_add",
    "apply_rotary_pos_emb",
    "scaled_upper_triang_masked_softmax",
    "scaled_masked_softmax",
]


def load_extension():
    """Finds, or builds, the CUDA extension now rather than at the first fused op.

    Returns:
        True when the extension is loaded; False without CUDA, or when fused
        kernels are turned off (then nothing is built).
    """
    return fused_enabled() and fused.available()


def layer_norm(x, weight, bias, eps):
    """LayerNorm over the last dim in float32; returns x's dtype. ``bias`` may be None."""
    impl = choose("layer_norm", x, reference.layer_norm, apex_ops.layer_norm_op)
    return impl(x, weight, bias, eps)


def rms_norm(x, weight, eps):
    """RMSNorm ``x * rsqrt(mean(x^2) + eps) * weight`` in float32; returns x's dtype."""
    impl = choose("rms_norm", x, reference.rms_norm, apex_ops.rms_norm_op)
    return impl(x, weight, eps)


def bias_gelu(x, bias):
    """GELU (tanh approximation) of ``x + bias``; ``bias`` may be None."""
    impl = choose("bias_gelu", x, reference.bias_gelu)
    return impl(x, bias)


def swiglu(x):
    """``silu(gate) * up`` where the last dim of ``x`` is [gate, up]."""
    impl = choose("swiglu", x, reference.swiglu)
    return impl(x)


def bias_dropout_add(x, bias, residual, prob, training):
    """``residual + dropout(x + bias, prob)``; ``bias`` may be None."""
    impl = choose("bias_dropout_add", x, reference.bias_dropout_add)
    return impl(x, bias, residual, prob, training)


def apply_rotary_pos_emb(t, freqs):
    """Rotary embedding of t [s, b, heads, d] by angles freqs [s, 1, 1, rot_dim], or [s, b, 1, rot_dim]
    when positions differ between samples (packed sequences restart them at each example)."""
    seq, batch = t.shape[:2]
    if freqs.shape[1] != 1:
        # The kernels take one row of angles per sequence position: fold the batch into the sequence
        # (a view for the query and key layouts attention produces).
        folded = apply_rotary_pos_emb(t.reshape(seq * batch, 1, *t.shape[2:]),
                                      freqs.reshape(seq * batch, 1, 1, freqs.shape[-1]))
        return folded.reshape(t.shape)
    impl = choose("apply_rotary_pos_emb", t, reference.apply_rotary_pos_emb, apex_ops.rotary_op)
    return impl(t, freqs)


def scaled_upper_triang_masked_softmax(x, scale):
    """Causal softmax of ``x * scale``; x is [batch * heads, sq, sk]."""
    impl = choose(
        "scaled_upper_triang_masked_softmax", x, reference.scaled_upper_triang_masked_softmax
    )
    return impl(x, scale)


def scaled_masked_softmax(x, mask, scale):
    """Softmax of ``x * scale`` with bool ``mask`` (True = masked); fully masked rows are zero."""
    impl = choose("scaled_masked_softmax", x, reference.scaled_masked_softmax)
    return impl(x, mask, scale)
