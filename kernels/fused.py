"""Autograd Functions over the CUDA extension's forward and backward kernels.

Each public function takes the reference's arguments. Inputs the kernels do not
cover (other dtypes, layouts, broadcasting) go to the reference, so callers never
need to know which inputs a kernel supports.

Every backward calls raw extension ops, which autograd cannot see through, so each
is marked ``_first_order_only``: a double backward raises instead of silently leaving out
the kernel's second-order terms.
"""
import functools

import torch

from . import extension, reference

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available():
    """True when the extension is built (or could be built) and loads."""
    return extension.load() is not None


def _ops():
    return extension.load()


def _kernel_supports(x):
    """Kernels take float32/float16/bfloat16; empty tensors are left to the reference."""
    return x.dtype in _KERNEL_DTYPES and x.numel() > 0


def _first_order_only(backward):
    """Marks a backward once-differentiable: it raises when asked to build a graph (``create_graph=True``),
    since its raw ops would record none.

    torch's ``once_differentiable`` is not enough here. It raises only when a second backward
    reaches its error node, which ``torch.autograd.grad(..., inputs=x)`` prunes (that node leads to
    no input), and only when the incoming gradient itself needs a graph, while these gradients also
    depend on saved activations. Both gaps would return a gradient silently missing the kernel's terms.
    """
    @functools.wraps(backward)
    def checked_backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError(f"megatron_lite's fused kernels have no double backward ({type(ctx).__name__} was "
                               f"asked for one by create_graph=True); run with --no-fused-kernels (or "
                               f"MEGATRON_LITE_NO_FUSED_KERNELS=1) so the PyTorch implementations run.")
        return backward(ctx, *grad_outputs)
    return checked_backward


def _rows_view(grad):
    return grad.reshape(-1, grad.shape[-1])


def _fits_rows(param, x):
    """Whether the kernels, which apply a weight or bias's h values to every row, compute what the
    reference's broadcast does: h elements along the last dim, leading dims of size one, and no more
    dims than ``x`` (more would add dims to the reference's output)."""
    return param is None or (param.shape[-1:] == x.shape[-1:] and param.numel() == x.shape[-1]
                              and param.dim() <= x.dim())


def _as_param_grad(grad, shape):
    """The kernels return an [h] gradient; autograd wants the parameter's own shape (e.g. [1, h])."""
    return None if grad is None else grad.view(shape)


class _Norm(torch.autograd.Function):
    """LayerNorm / RMSNorm; weight and bias arrive as float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        y, mean, rstd = _ops().norm_forward(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        ctx.weight_shape, ctx.bias_shape = weight.shape, None if bias is None else bias.shape
        return y

    @staticmethod
    @_first_order_only
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = _ops().norm_backward(
            dy.contiguous(), x, weight, mean, rstd, ctx.rms, ctx.has_bias
        )
        return dx, _as_param_grad(dweight, ctx.weight_shape), _as_param_grad(dbias, ctx.bias_shape), None, None


def layer_norm(x, weight, bias, eps):
    # The reference (F.layer_norm) takes weight and bias of exactly [h] and says so for any other shape.
    params_fit = weight.shape == x.shape[-1:] and (bias is None or bias.shape == x.shape[-1:])
    if not _kernel_supports(x) or not params_fit:
        return reference.layer_norm(x, weight, bias, eps)
    bias = None if bias is None else bias.float().contiguous()
    return _Norm.apply(x.contiguous(), weight.float().contiguous(), bias, eps, False)


def rms_norm(x, weight, eps):
    if not _kernel_supports(x) or not _fits_rows(weight, x):
        return reference.rms_norm(x, weight, eps)
    return _Norm.apply(x.contiguous(), weight.float().contiguous(), None, eps, True)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return _ops().bias_gelu_forward(x, bias)

    @staticmethod
    @_first_order_only
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = _ops().bias_gelu_backward(dy.contiguous(), x, bias)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = _as_param_grad(_rows_view(dx).sum(0), bias.shape)
        return dx, dbias


def bias_gelu(x, bias):
    if not _kernel_supports(x) or not _fits_rows(bias, x):
        return reference.bias_gelu(x, bias)
    # The reference adds the bias in x's dtype; the kernel takes it in x's dtype too.
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    return _BiasGelu.apply(x.contiguous(), bias)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _ops().swiglu_forward(x)

    @staticmethod
    @_first_order_only
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _ops().swiglu_backward(dy.contiguous(), x)


def swiglu(x):
    if not _kernel_supports(x) or x.shape[-1] % 2:
        return reference.swiglu(x)
    return _SwiGLU.apply(x.contiguous())


class _BiasDropoutAdd(torch.autograd.Function):
    """The keep mask is regenerated in backward from a seed drawn in forward."""

    @staticmethod
    def forward(ctx, x, bias, residual, keep_prob):
        seed = None
        if keep_prob < 1.0:
            # Drawn from PyTorch's CUDA generator, so RNG-state forking (tensor-parallel
            # dropout) and activation recomputation reproduce the same mask.
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=x.device)
        ctx.save_for_backward(seed)
        ctx.keep_prob, ctx.bias_shape = keep_prob, None if bias is None else bias.shape
        return _ops().bias_dropout_add_forward(x, bias, residual, seed, keep_prob)

    @staticmethod
    @_first_order_only
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        dx = dy
        if ctx.keep_prob < 1.0:
            dx = _ops().dropout_backward(dy.contiguous(), seed, ctx.keep_prob)
        dbias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[1]:
            dbias = _as_param_grad(_rows_view(dx).sum(0), ctx.bias_shape)
        return dx, dbias, dy, None


def bias_dropout_add(x, bias, residual, prob, training):
    if not 0.0 <= prob <= 1.0:
        # F.dropout's check and words: p > 1 would make keep_prob negative and drop every element.
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {prob}")
    if (not _kernel_supports(x) or residual.dtype != x.dtype or residual.shape != x.shape
            or not _fits_rows(bias, x)):
        return reference.bias_dropout_add(x, bias, residual, prob, training)
    keep_prob = 1.0 - prob if training else 1.0
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    return _BiasDropoutAdd.apply(x.contiguous(), bias, residual.contiguous(), keep_prob)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return _ops().rotary_forward(t, freqs)

    @staticmethod
    @_first_order_only
    def backward(ctx, dy):
        (freqs,) = ctx.saved_tensors
        return _ops().rotary_backward(dy.contiguous(), freqs), None


def apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs.shape[-1]
    if (
        not _kernel_supports(t)
        or t.dim() != 4
        or freqs.dim() != 4
        or freqs.shape[:3] != (t.shape[0], 1, 1)
        or rot_dim % 2
        or rot_dim > t.shape[-1]
        or freqs.requires_grad
    ):
        return reference.apply_rotary_pos_emb(t, freqs)
    return _Rotary.apply(t.contiguous(), freqs.float().contiguous())


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale, causal):
        y = _ops().softmax_forward(x, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    @_first_order_only
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _ops().softmax_backward(dy.contiguous(), y, ctx.scale), None, None, None


def scaled_upper_triang_masked_softmax(x, scale):
    if not _kernel_supports(x) or x.dim() != 3 or x.shape[-1] < x.shape[-2]:
        return reference.scaled_upper_triang_masked_softmax(x, scale)
    return _Softmax.apply(x.contiguous(), None, float(scale), True)


def scaled_masked_softmax(x, mask, scale):
    if not _kernel_supports(x) or x.dim() != 4 or (mask is not None and mask.dtype != torch.bool):
        return reference.scaled_masked_softmax(x, mask, scale)
    if mask is not None:
        # Broadcast dims get stride 0, so the kernel reads a [b, 1, sq, sk] mask in place.
        mask = mask.expand_as(x)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    return _Softmax.apply(x.contiguous(), mask, float(scale), False)
