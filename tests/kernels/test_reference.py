"""The PyTorch reference ops against straightforward float64 math: values and gradients."""
import math

import pytest
import torch

from megatron_lite.kernels import reference
from tests.kernels import math_reference as oracle

DTYPES = [torch.float32, torch.bfloat16]


def compare(ref_fn, oracle_fn, args, dtype, factor=1.0):
    """Runs ref_fn on args cast to dtype and oracle_fn on the same values in float64;
    compares outputs and the gradients of every floating-point tensor argument."""
    low = [a.to(dtype).requires_grad_() if _is_float(a) else a for a in args]
    high = [a.detach().double().requires_grad_() if _is_float(a) else a for a in low]
    out_low, out_high = ref_fn(*low), oracle_fn(*high)
    assert out_low.dtype == dtype
    oracle.assert_close(out_low, out_high, dtype, "output", factor)
    dy = torch.randn(out_high.shape, dtype=torch.float64).to(dtype)
    inputs_low = [a for a in low if _is_float(a)]
    inputs_high = [a for a in high if _is_float(a)]
    grads_low = torch.autograd.grad(out_low, inputs_low, dy)
    grads_high = torch.autograd.grad(out_high, inputs_high, dy.double())
    for i, (g_low, g_high) in enumerate(zip(grads_low, grads_high)):
        oracle.assert_close(g_low, g_high, dtype, f"grad of input {i}", factor)


def _is_float(a):
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def randn(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, dtype=torch.float64) * scale + shift


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 33), (2, 8193)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(dtype, shape, with_bias):
    hidden = shape[-1]
    bias = randn(hidden) if with_bias else None
    args = [randn(*shape, scale=3.0, shift=1.5), randn(hidden, shift=1.0), bias, 1e-5]
    compare(reference.layer_norm, oracle.layer_norm, args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 33), (2, 8193)])
def test_rms_norm(dtype, shape):
    args = [randn(*shape, scale=3.0, shift=0.5), randn(shape[-1], shift=1.0), 1e-6]
    compare(reference.rms_norm, oracle.rms_norm, args, dtype)


def test_norms_keep_float32_precision_for_half_inputs():
    # Statistics in float32: a large common offset must not wipe out the variance.
    x = (torch.randn(4, 64, dtype=torch.float64) + 300.0).to(torch.bfloat16)
    y = reference.layer_norm(x, torch.ones(64, dtype=torch.bfloat16), None, 1e-5)
    expected = oracle.layer_norm(x.double(), torch.ones(64, dtype=torch.float64), None, 1e-5)
    oracle.assert_close(y, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 129)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(dtype, shape, with_bias):
    bias = randn(shape[-1]) if with_bias else None
    compare(reference.bias_gelu, oracle.bias_gelu, [randn(*shape, scale=2.0), bias], dtype)


def test_bias_gelu_keeps_x_dtype_with_a_float32_bias():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert reference.bias_gelu(x, torch.randn(8)).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 14), (2, 3, 258)])
def test_swiglu(dtype, shape):
    compare(reference.swiglu, oracle.swiglu, [randn(*shape, scale=2.0)], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prob,training", [(0.0, True), (0.4, False)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_without_dropping(dtype, prob, training, with_bias):
    shape = (5, 3, 17)
    bias = randn(17) if with_bias else None

    def ref(x, b, residual):
        return reference.bias_dropout_add(x, b, residual, prob, training)

    def math_fn(x, b, residual):
        return residual + (x if b is None else x + b)

    compare(ref, math_fn, [randn(*shape), bias, randn(*shape)], dtype)


@pytest.mark.parametrize("prob", [1.5, -0.1])
@pytest.mark.parametrize("training", [True, False])
def test_bias_dropout_add_refuses_a_probability_outside_zero_one_as_F_dropout(prob, training):
    # Outside training the dropout is skipped, but not its check of the probability.
    x = torch.randn(3, 4)
    with pytest.raises(ValueError) as expected:
        torch.nn.functional.dropout(x, p=prob, training=training)
    with pytest.raises(ValueError) as raised:
        reference.bias_dropout_add(x, None, x, prob, training)
    assert str(raised.value) == str(expected.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_drops_and_rescales(dtype):
    prob, shape = 0.3, (40, 3, 257)
    x = torch.randn(shape).to(dtype).requires_grad_()
    bias = torch.randn(257).to(dtype).requires_grad_()
    residual = torch.randn(shape).to(dtype).requires_grad_()
    out = reference.bias_dropout_add(x, bias, residual, prob, True)

    # The keep mask, read off the gradient for dy = 1 (exact: 0 or 1 / (1 - p)).
    (dx_ones,) = torch.autograd.grad(out, x, torch.ones_like(out), retain_graph=True)
    kept = dx_ones != 0
    assert abs(kept.double().mean().item() - (1 - prob)) < 0.01
    oracle.assert_close(dx_ones, kept / (1 - prob), dtype, "dx for dy = 1")
    expected = residual.double() + kept * (x.double() + bias.double()) / (1 - prob)
    oracle.assert_close(out, expected, dtype, "output")

    dy = torch.randn(shape).to(dtype)
    dx, dbias, dresidual = torch.autograd.grad(out, [x, bias, residual], dy)
    expected_dx = dy.double() * kept / (1 - prob)
    oracle.assert_close(dx, expected_dx, dtype, "dx")
    oracle.assert_close(dbias, expected_dx.sum((0, 1)), dtype, "dbias")
    assert torch.equal(dresidual, dy)


def rotary_freqs(seq, rot_dim):
    """Angles [seq, 1, 1, rot_dim] laid out as cat(f, f), as the model builds them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rot_dim", [((5, 3, 2, 8), 8), ((7, 1, 3, 10), 6), ((33, 2, 1, 64), 64)])
def test_rotary(dtype, shape, rot_dim):
    freqs = rotary_freqs(shape[0], rot_dim).float()

    def ref(t):
        return reference.apply_rotary_pos_emb(t, freqs)

    def math_fn(t):
        return oracle.rotary(t, freqs.double())

    compare(ref, math_fn, [randn(*shape)], dtype)


def test_rotary_rejects_odd_or_too_wide_rotary_dim():
    t = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="rotary dim"):
        reference.apply_rotary_pos_emb(t, torch.randn(4, 1, 1, 5))
    with pytest.raises(ValueError, match="rotary dim"):
        reference.apply_rotary_pos_emb(t, torch.randn(4, 1, 1, 10))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 37, 37), (4, 5, 9), (2, 3, 5000)])
def test_scaled_upper_triang_masked_softmax(dtype, shape):
    _, sq, sk = shape
    scale = 1 / math.sqrt(64)

    def ref(x):
        return reference.scaled_upper_triang_masked_softmax(x, scale)

    def math_fn(x):
        return oracle.masked_softmax(x, oracle.causal_mask(sq, sk), scale)

    compare(ref, math_fn, [randn(*shape, scale=4.0)], dtype)


def test_causal_softmax_masks_the_future():
    probs = reference.scaled_upper_triang_masked_softmax(torch.randn(2, 4, 4), 1.0)
    assert torch.equal(probs == 0, oracle.causal_mask(4, 4).expand(2, 4, 4))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4))
    with pytest.raises(ValueError, match="at least as many keys"):
        reference.scaled_upper_triang_masked_softmax(torch.randn(2, 5, 4), 1.0)


def random_mask(shape, fully_masked_rows):
    mask = torch.rand(shape) < 0.3
    for b, q in fully_masked_rows:
        mask[b, :, q, :] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,mask_shape",
    [((2, 3, 5, 7), (2, 1, 5, 7)), ((1, 2, 3, 4099), (1, 1, 3, 4099)), ((2, 2, 4, 9), (2, 1, 1, 9))],
)
def test_scaled_masked_softmax(dtype, shape, mask_shape):
    fully_masked = [(0, 0)] if mask_shape[2] > 1 else []
    mask = random_mask(mask_shape, fully_masked)
    scale = 0.125

    def ref(x):
        return reference.scaled_masked_softmax(x, mask, scale)

    def math_fn(x):
        return oracle.masked_softmax(x, mask, scale)

    compare(ref, math_fn, [randn(*shape, scale=4.0)], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_zero_in_value_and_gradient(dtype):
    x = torch.randn(2, 3, 4, 6).to(dtype).requires_grad_()
    mask = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
    mask[1, 0, 2] = True
    mask[0, 0, :, 0] = True
    probs = reference.scaled_masked_softmax(x, mask, 2.0)
    assert torch.isfinite(probs).all()
    assert (probs[1, :, 2] == 0).all() and (probs[0, :, :, 0] == 0).all()
    (grad,) = torch.autograd.grad(probs, x, torch.randn_like(probs))
    assert torch.isfinite(grad).all()
    assert (grad[1, :, 2] == 0).all() and (grad[0, :, :, 0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_masked_softmax_without_mask(dtype):
    def math_fn(x):
        return oracle.masked_softmax(x, torch.zeros(1, dtype=torch.bool), 0.5)

    compare(lambda x: reference.scaled_masked_softmax(x, None, 0.5), math_fn, [randn(2, 2, 3, 11)], dtype)
