"""The autograd wrappers around the CUDA extension, run on CPU through the dispatch.

A stand-in extension has the real one's raw ops (same signatures, weights and biases
read as h plain values, outputs without autograd history) computed by the PyTorch
reference, so what the wrappers add (shapes, argument checks, which inputs go to the
reference, how backward is exposed to autograd) is tested without a GPU. The kernels
themselves are tested on GPU in tests/gpu/test_fused_kernels.py.
"""
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.kernels import dispatch, extension, fused, reference

CUDA_LIKE = types.SimpleNamespace(is_cuda=True)


def _vjp(fn, inputs, dy):
    """Gradients of ``fn(*inputs)`` with respect to every tensor input (None stays None), detached."""
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        grads = iter(torch.autograd.grad(fn(*leaves), [t for t in leaves if t is not None], dy))
    return [None if t is None else next(grads) for t in leaves]


def _check_row_param(param, x, name):
    # bindings.cpp's check: a weight or bias is h values, whatever its shape.
    if param is not None and param.numel() != x.shape[-1]:
        raise RuntimeError(f"{name} must have {x.shape[-1]} elements")


def _dropout_mask(seed, shape, keep_prob):
    generator = torch.Generator().manual_seed(int(seed.item()))
    return torch.rand(shape, generator=generator) < keep_prob


class StandInExtension:
    """The extension's ops (csrc/bindings.cpp) on CPU, by the reference."""

    @staticmethod
    def norm_forward(x, weight, bias, eps, rms):
        _check_row_param(weight, x, "weight")
        _check_row_param(bias, x, "bias")
        weight, bias = weight.reshape(-1), None if bias is None else bias.reshape(-1)
        xf = x.float()
        mean = torch.empty(0) if rms else xf.mean(-1).reshape(-1)
        centred = xf if rms else xf - xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(centred.pow(2).mean(-1) + eps).reshape(-1)
        y = reference.rms_norm(x, weight, eps) if rms else reference.layer_norm(x, weight, bias, eps)
        return y, mean, rstd

    @staticmethod
    def norm_backward(dy, x, weight, mean, rstd, rms, has_bias):
        # From the saved statistics, as the kernel does: g = dy * w, x_hat = (x - mean) * rstd,
        # dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) (RMSNorm: no mean terms).
        dyf, xf = dy.float().reshape(-1, x.shape[-1]), x.float().reshape(-1, x.shape[-1])
        rstd = rstd.view(-1, 1)
        x_hat = (xf if rms else xf - mean.view(-1, 1)) * rstd
        g = dyf * weight.reshape(-1)
        inner = g - x_hat * (g * x_hat).mean(-1, keepdim=True)
        dx = rstd * (inner if rms else inner - g.mean(-1, keepdim=True))
        dbias = dyf.sum(0) if has_bias else None
        return dx.view(x.shape).to(x.dtype), (dyf * x_hat).sum(0), dbias

    @staticmethod
    def bias_gelu_forward(x, bias):
        _check_row_param(bias, x, "bias")
        return reference.bias_gelu(x, None if bias is None else bias.reshape(-1))

    @staticmethod
    def bias_gelu_backward(dy, x, bias):
        bias = None if bias is None else bias.reshape(-1)
        return _vjp(lambda x: reference.bias_gelu(x, bias), [x], dy)[0]

    @staticmethod
    def swiglu_forward(x):
        return reference.swiglu(x)

    @staticmethod
    def swiglu_backward(dy, x):
        return _vjp(reference.swiglu, [x], dy)[0]

    @staticmethod
    def bias_dropout_add_forward(x, bias, residual, seed, keep_prob):
        _check_row_param(bias, x, "bias")
        v = x if bias is None else x + bias.reshape(-1)
        if keep_prob < 1.0:
            v = torch.where(_dropout_mask(seed, x.shape, keep_prob), v / keep_prob, torch.zeros_like(v))
        return residual + v

    @staticmethod
    def dropout_backward(dy, seed, keep_prob):
        return torch.where(_dropout_mask(seed, dy.shape, keep_prob), dy / keep_prob, torch.zeros_like(dy))

    @staticmethod
    def rotary_forward(t, freqs):
        return reference.apply_rotary_pos_emb(t, freqs)

    @staticmethod
    def rotary_backward(dy, freqs):
        return _vjp(lambda t: reference.apply_rotary_pos_emb(t, freqs), [torch.zeros_like(dy)], dy)[0]

    @staticmethod
    def softmax_forward(x, mask, scale, causal):
        if causal:
            return reference.scaled_upper_triang_masked_softmax(x, scale)
        return reference.scaled_masked_softmax(x, mask, scale)

    @staticmethod
    def softmax_backward(dy, y, scale):
        dyf, yf = dy.float(), y.float()
        return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


@pytest.fixture(autouse=True)
def stand_in_extension(monkeypatch):
    monkeypatch.setattr(extension, "load", lambda: StandInExtension)
    monkeypatch.setattr(dispatch, "_use_fused", True)
    monkeypatch.delenv(dispatch.DISABLE_ENV_VAR, raising=False)


def fused_op(name):
    """What the dispatch picks for a CUDA tensor: the extension's wrapper (called here with CPU tensors)."""
    impl = dispatch.choose(name, CUDA_LIKE, getattr(reference, name))
    assert impl is getattr(fused, name)
    return impl


H = 8


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=True)


# (op, build(x) -> (inputs that take gradients, call(*inputs)), the wrapper's autograd node)
CASES = {
    "rms_norm": (lambda x: ([x, torch.linspace(0.5, 1.5, H).view(1, H).requires_grad_()],
                            lambda op, x, w: op(x, w, 1e-5)), "_NormBackward"),
    "rms_norm_3d_weight": (lambda x: ([x, torch.linspace(0.5, 1.5, H).view(1, 1, H).requires_grad_()],
                                      lambda op, x, w: op(x, w, 1e-5)), "_NormBackward"),
    "bias_gelu": (lambda x: ([x, torch.linspace(-1, 1, H).view(1, H).requires_grad_()],
                             lambda op, x, b: op(x, b)), "_BiasGeluBackward"),
    "bias_dropout_add": (lambda x: ([x, torch.linspace(-1, 1, H).view(1, 1, H).requires_grad_(), x.detach() * 2],
                                    lambda op, x, b, r: op(x, b, r, 0.3, False)), "_BiasDropoutAddBackward"),
}


def _op_name(case):
    return case.removesuffix("_3d_weight")


@pytest.mark.parametrize("case", sorted(CASES))
def test_weight_or_bias_with_leading_ones_gets_a_gradient_of_its_own_shape(case):
    # The reference broadcasts a [1, h] (or [1, 1, h]) parameter; autograd needs its gradient in that shape.
    build, node = CASES[case]
    x = _x(3, 2, H)
    inputs, call = build(x)
    out = call(fused_op(_op_name(case)), *inputs)
    assert type(out.grad_fn).__name__ == node, out.grad_fn
    expected = call(getattr(reference, _op_name(case)), *inputs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(out, leaves, dy)
    expected_grads = torch.autograd.grad(expected, leaves, dy)
    torch.testing.assert_close(out, expected)
    for leaf, grad, expected_grad in zip(leaves, grads, expected_grads):
        assert grad.shape == leaf.shape
        torch.testing.assert_close(grad, expected_grad)


def test_a_bias_the_kernel_cannot_apply_row_wise_takes_the_reference():
    x = _x(3, 2, H)
    per_batch_bias = torch.randn(2, H, requires_grad=True)  # [b, h] broadcasts over s only
    for name, call in [("bias_gelu", lambda op: op(x, per_batch_bias)),
                       ("bias_dropout_add", lambda op: op(x, per_batch_bias, x.detach(), 0.0, False))]:
        out = call(fused_op(name))
        assert "Bias" not in type(out.grad_fn).__name__, (name, out.grad_fn)
        torch.testing.assert_close(out, call(getattr(reference, name)))
        (grad,) = torch.autograd.grad(out.sum(), per_batch_bias)
        assert grad.shape == per_batch_bias.shape


def test_layer_norm_refuses_a_non_1d_weight_as_the_reference_does():
    x, weight = _x(3, 2, H), torch.ones(1, H, requires_grad=True)
    with pytest.raises(RuntimeError) as expected:
        reference.layer_norm(x, weight, None, 1e-5)
    with pytest.raises(RuntimeError) as raised:
        fused_op("layer_norm")(x, weight, None, 1e-5)
    assert str(raised.value) == str(expected.value)


@pytest.mark.parametrize("prob", [1.5, -0.1])
@pytest.mark.parametrize("training", [True, False])
def test_dropout_probability_outside_zero_one_raises_as_F_dropout(prob, training):
    x = _x(3, 2, H)
    with pytest.raises(ValueError) as expected:
        F.dropout(x, p=prob, training=training)
    with pytest.raises(ValueError) as raised:
        fused_op("bias_dropout_add")(x, None, x.detach(), prob, training)
    assert str(raised.value) == str(expected.value)


def test_dropout_probability_one_drops_everything():
    x = _x(3, 2, H)
    residual = torch.randn(3, 2, H)
    out = fused_op("bias_dropout_add")(x, None, residual, 1.0, True)
    assert type(out.grad_fn).__name__ == "_BiasDropoutAddBackward"
    torch.testing.assert_close(out, residual)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.zeros_like(x))


def _freqs(seq, rot_dim):
    return torch.arange(seq * rot_dim, dtype=torch.float32).view(seq, 1, 1, rot_dim) * 0.1


MASK = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(2)) < 0.3

# op -> (x shape, call, the wrapper's autograd node): every autograd Function of fused.py.
DOUBLE_BACKWARD = {
    "layer_norm": ((3, 2, H), lambda op, x: op(x, torch.ones(H), torch.zeros(H), 1e-5), "_NormBackward"),
    "rms_norm": ((3, 2, H), lambda op, x: op(x, torch.ones(H), 1e-5), "_NormBackward"),
    "bias_gelu": ((3, 2, H), lambda op, x: op(x, torch.ones(H)), "_BiasGeluBackward"),
    "swiglu": ((3, 2, H), lambda op, x: op(x), "_SwiGLUBackward"),
    "bias_dropout_add": ((3, 2, H), lambda op, x: op(x, None, torch.ones(3, 2, H), 0.0, False),
                         "_BiasDropoutAddBackward"),
    "apply_rotary_pos_emb": ((3, 2, 1, H), lambda op, x: op(x, _freqs(3, H)), "_RotaryBackward"),
    "scaled_upper_triang_masked_softmax": ((2, 4, 4), lambda op, x: op(x, 0.5), "_SoftmaxBackward"),
    "scaled_masked_softmax": ((2, 1, 4, 4), lambda op, x: op(x, MASK, 0.5),
                              "_SoftmaxBackward"),
}


@pytest.mark.parametrize("name", sorted(DOUBLE_BACKWARD))
def test_double_backward_raises_instead_of_dropping_the_kernels_terms(name):
    shape, call, node = DOUBLE_BACKWARD[name]
    x = _x(*shape)
    out = call(fused_op(name), x)
    assert type(out.grad_fn).__name__ == node, out.grad_fn
    # First order through the stand-in kernels equals the reference's.
    expected = call(getattr(reference, name), x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.pow(2).sum(), x, retain_graph=True)[0],
                               torch.autograd.grad(expected.pow(2).sum(), x)[0])
    # The x**2 term keeps the first-order gradient differentiable, so a second backward would succeed and
    # silently miss the kernel's second-order terms. torch's once_differentiable alone lets autograd.grad
    # prune its error node and return that wrong gradient: the first backward must refuse to build a graph.
    with pytest.raises(RuntimeError, match="no double backward .*--no-fused-kernels"):
        torch.autograd.grad(out.pow(2).sum() + x.pow(2).sum(), x, create_graph=True)
