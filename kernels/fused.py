"""Autograd Functions over the CUDA extension's forward and backward kernels.

Each public function takes the reference's arguments. Inputs the kernels do not
cover (other dtypes, layouts, broadcasting) go to the reference, so callers never
need to know which inputs a kernel supports.
"""
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


def _rows_view(grad):
    return grad.reshape(-1, grad.shape[-1])


class _Norm(torch.autograd.Function):
    """LayerNorm / RMSNorm; weight and bias arrive as float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        y, mean, rstd = _ops().norm_forward(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = _ops().norm_backward(
            dy.contiguous(), x, weight, mean, rstd, ctx.rms, ctx.has_bias
        )
        return dx, dweight, dbias, None, None


def layer_norm(x, weight, bias, eps):
    if not _kernel_supports(x):
        return reference.layer_norm(x, weight, bias, eps)
    bias = None if bias is None else bias.float().contiguous()
    return _Norm.apply(x.contiguous(), weight.float().contiguous(), bias, eps, False)


def rms_norm(x, weight, eps):
    if not _kernel_supports(x):
        return reference.rms_norm(x, weight, eps)
    return _Norm.apply(x.contiguous(), weight.float().contiguous(), None, eps, True)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return _ops().bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = _ops().bias_gelu_backward(dy.contiguous(), x, bias)
        dbias = _rows_view(dx).sum(0) if bias is not None and ctx.needs_input_grad[1] else None
        return dx, dbias


def bias_gelu(x, bias):
    if not _kernel_supports(x):
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
        ctx.keep_prob, ctx.has_bias = keep_prob, bias is not None
        return _ops().bias_dropout_add_forward(x, bias, residual, seed, keep_prob)

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        dx = dy
        if ctx.keep_prob < 1.0:
            dx = _ops().dropout_backward(dy.contiguous(), seed, ctx.keep_prob)
        dbias = _rows_view(dx).sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return dx, dbias, dy, None


def bias_dropout_add(x, bias, residual, prob, training):
    if not _kernel_supports(x) or residual.dtype != x.dtype or residual.shape != x.shape:
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
