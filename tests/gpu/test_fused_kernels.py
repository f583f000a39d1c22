"""Each CUDA kernel against float64 math and the PyTorch reference: values and gradients.

Sizes are deliberately not multiples of the kernels' block, warp or vector widths.
"""
import math

import numpy as np
import pytest
import torch

import megatron_lite.kernels as kernels
from megatron_lite.kernels import fused, reference
from tests.kernels import math_reference as oracle
from tests.kernels.philox import dropout_uniforms

DEVICE = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernels sum in a different order than float64 math; allow a few float32 roundings.
FP32_FACTOR = 5.0


@pytest.fixture(scope="module", autouse=True)
def _extension():
    assert fused.available(), "CUDA is available but the extension neither imports nor builds (see warnings)"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)


def randn(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, dtype=torch.float64, device=DEVICE) * scale + shift


def _is_float(a):
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def check(fused_fn, oracle_fn, args, dtype, node):
    """Runs fused_fn on args cast to dtype and oracle_fn in float64 on the same values;
    checks that the kernel ran (grad_fn ``node``) and compares outputs and gradients.
    The reference is held to the same bound, so a failure names the kernel, not the test."""
    factor = FP32_FACTOR if dtype == torch.float32 else 1.0
    low = [a.to(dtype).requires_grad_() if _is_float(a) else a for a in args]
    high = [a.detach().double().requires_grad_() if _is_float(a) else a for a in low]
    out, expected = fused_fn(*low), oracle_fn(*high)
    assert type(out.grad_fn).__name__ == node, f"fused path did not run: {out.grad_fn}"
    assert out.dtype == dtype
    oracle.assert_close(out, expected, dtype, "output", factor)
    dy = torch.randn(expected.shape, dtype=torch.float64, device=DEVICE).to(dtype)
    grads = torch.autograd.grad(out, [a for a in low if _is_float(a)], dy)
    expected_grads = torch.autograd.grad(expected, [a for a in high if _is_float(a)], dy.double())
    for i, (g, e) in enumerate(zip(grads, expected_grads)):
        assert g.dtype == low[[j for j, a in enumerate(low) if _is_float(a)][i]].dtype
        oracle.assert_close(g, e, dtype, f"grad of input {i}", factor)


# ---------------------------------------------------------------------------- norms

NORM_SHAPES = [(3, 7), (2, 5, 33), (1, 3), (3000, 1000), (4, 4097), (2, 12289)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(dtype, shape, with_bias):
    hidden = shape[-1]
    bias = randn(hidden) if with_bias else None
    args = [randn(*shape, scale=3.0, shift=1.5), randn(hidden, shift=1.0), bias, 1e-5]
    check(fused.layer_norm, oracle.layer_norm, args, dtype, "_NormBackward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(dtype, shape):
    args = [randn(*shape, scale=3.0, shift=0.5), randn(shape[-1], shift=1.0), 1e-6]
    check(fused.rms_norm, oracle.rms_norm, args, dtype, "_NormBackward")


def test_norm_with_float32_weight_and_bfloat16_input():
    x = randn(33, 257).bfloat16().requires_grad_()
    w = randn(257, shift=1.0).float().requires_grad_()
    b = randn(257).float().requires_grad_()
    y = fused.layer_norm(x, w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w, b], dy)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    expected = oracle.layer_norm(xd, wd, bd, 1e-5)
    oracle.assert_close(y, expected, torch.bfloat16)
    for g, e, dtype in zip(grads, torch.autograd.grad(expected, [xd, wd, bd], dy.double()),
                           (torch.bfloat16, torch.float32, torch.float32)):
        assert g.dtype == dtype
        oracle.assert_close(g, e, torch.bfloat16)


# ---------------------------------------------------------------------- activations

ELEMENTWISE_SHAPES = [(3, 7), (5, 3, 1001), (513, 4099)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(dtype, shape, with_bias):
    bias = randn(shape[-1]) if with_bias else None
    check(fused.bias_gelu, oracle.bias_gelu, [randn(*shape, scale=2.0), bias], dtype, "_BiasGeluBackward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 14), (5, 3, 2002), (513, 8198)])
def test_swiglu(dtype, shape):
    check(fused.swiglu, oracle.swiglu, [randn(*shape, scale=2.0)], dtype, "_SwiGLUBackward")


# ------------------------------------------------------------------ dropout + add

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_without_dropping(dtype, shape, with_bias):
    bias = randn(shape[-1]) if with_bias else None

    def fused_fn(x, b, residual):
        return fused.bias_dropout_add(x, b, residual, 0.1, False)

    def oracle_fn(x, b, residual):
        return residual + (x if b is None else x + b)

    check(fused_fn, oracle_fn, [randn(*shape), bias, randn(*shape)], dtype, "_BiasDropoutAddBackward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prob", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(3, 7), (129, 3, 1001)])
def test_dropout_mask_is_philox_and_backward_regenerates_it(dtype, prob, shape):
    x = randn(*shape).to(dtype).requires_grad_()
    bias = randn(shape[-1]).to(dtype).requires_grad_()
    residual = randn(*shape).to(dtype).requires_grad_()
    # The kernel's seed is the first draw from the CUDA generator after this reset.
    torch.cuda.manual_seed(77)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=DEVICE).item()
    torch.cuda.manual_seed(77)
    out = fused.bias_dropout_add(x, bias, residual, prob, True)
    assert type(out.grad_fn).__name__ == "_BiasDropoutAddBackward"

    keep_prob = np.float32(1.0 - prob)
    kept_np = dropout_uniforms(seed, out.numel()) < keep_prob
    kept = torch.from_numpy(kept_np).to(DEVICE).view(shape)
    assert abs(kept.double().mean().item() - keep_prob) < 0.05 + 3 / math.sqrt(out.numel())
    expected = residual.double() + kept * (x.double() + bias.double()) / float(keep_prob)
    oracle.assert_close(out, expected, dtype, "output")

    dy = torch.randn_like(out)
    dx, dbias, dresidual = torch.autograd.grad(out, [x, bias, residual], dy)
    expected_dx = dy.double() * kept / float(keep_prob)
    oracle.assert_close(dx, expected_dx, dtype, "dx")
    oracle.assert_close(dbias, expected_dx.reshape(-1, shape[-1]).sum(0), dtype, "dbias", factor=2.0)
    assert torch.equal(dresidual, dy)


def test_dropout_masks_follow_the_torch_generator():
    x, residual = randn(64, 1000).float(), torch.zeros(64, 1000, device=DEVICE)
    torch.cuda.manual_seed(5)
    first = fused.bias_dropout_add(x, None, residual, 0.5, True)
    second = fused.bias_dropout_add(x, None, residual, 0.5, True)
    torch.cuda.manual_seed(5)
    again = fused.bias_dropout_add(x, None, residual, 0.5, True)
    assert torch.equal(first, again) and not torch.equal(first, second)


# --------------------------------------------------------------------------- rotary

def rotary_freqs(seq, rot_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,rot_dim", [((5, 3, 2, 8), 8), ((7, 1, 3, 10), 6), ((257, 2, 5, 128), 128), ((33, 3, 7, 96), 64)]
)
def test_rotary(dtype, shape, rot_dim):
    freqs = rotary_freqs(shape[0], rot_dim).float()

    def fused_fn(t):
        return fused.apply_rotary_pos_emb(t, freqs)

    def oracle_fn(t):
        return oracle.rotary(t, freqs.double())

    check(fused_fn, oracle_fn, [randn(*shape)], dtype, "_RotaryBackward")


def test_rotary_on_a_non_contiguous_view():
    qkv = randn(9, 2, 3, 3 * 16).bfloat16()
    key = qkv[..., 16:32]
    freqs = rotary_freqs(9, 16).float()
    oracle.assert_close(
        fused.apply_rotary_pos_emb(key, freqs), oracle.rotary(key.double(), freqs.double()), torch.bfloat16
    )


# -------------------------------------------------------------------------- softmax

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 37, 37), (3, 5, 9), (2, 1, 1), (5, 33, 1025), (2, 3, 16385)])
def test_causal_softmax(dtype, shape):
    _, sq, sk = shape
    mask = oracle.causal_mask(sq, sk).to(DEVICE)

    def fused_fn(x):
        return fused.scaled_upper_triang_masked_softmax(x, 0.125)

    def oracle_fn(x):
        return oracle.masked_softmax(x, mask, 0.125)

    check(fused_fn, oracle_fn, [randn(*shape, scale=8.0)], dtype, "_SoftmaxBackward")


def masks(shape):
    """[b, 1, sq, sk] with a fully masked row, [b, 1, 1, sk] padding, [1, 1, sq, sk], full."""
    b, heads, sq, sk = shape
    per_query = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.3
    per_query[0, 0, sq // 2] = True
    valid_keys = torch.tensor([sk, sk // 2], device=DEVICE)[:b]
    padding = torch.arange(sk, device=DEVICE).view(1, 1, 1, sk) >= valid_keys.view(-1, 1, 1, 1)
    return {
        "per_query": per_query,
        "padding": padding,
        "shared": torch.rand(1, 1, sq, sk, device=DEVICE) < 0.5,
        "full": torch.rand(b, heads, sq, sk, device=DEVICE) < 0.5,
        "none": None,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 4, 33, 1000), (1, 2, 3, 8197)])
@pytest.mark.parametrize("mask_kind", ["per_query", "padding", "shared", "full", "none"])
def test_masked_softmax(dtype, shape, mask_kind):
    mask = masks(shape)[mask_kind]

    def fused_fn(x):
        return fused.scaled_masked_softmax(x, mask, 0.3)

    def oracle_fn(x):
        return oracle.masked_softmax(x, torch.zeros(1, dtype=torch.bool, device=DEVICE) if mask is None else mask, 0.3)

    check(fused_fn, oracle_fn, [randn(*shape, scale=4.0)], dtype, "_SoftmaxBackward")


def test_fully_masked_rows_are_zero_not_nan():
    x = randn(2, 3, 4, 50).half().requires_grad_()
    mask = torch.zeros(2, 1, 4, 50, dtype=torch.bool, device=DEVICE)
    mask[1, 0, 2] = True
    probs = fused.scaled_masked_softmax(x, mask, 1.0)
    (grad,) = torch.autograd.grad(probs, x, torch.randn_like(probs))
    assert torch.isfinite(probs).all() and torch.isfinite(grad).all()
    assert (probs[1, :, 2] == 0).all() and (grad[1, :, 2] == 0).all()


# ------------------------------------------------------------------------- dispatch

def test_public_ops_take_the_cuda_path_unless_turned_off():
    x = randn(4, 64).bfloat16().requires_grad_()
    w = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    try:
        assert type(kernels.rms_norm(x, w, 1e-6).grad_fn).__name__ == "_NormBackward"
        kernels.configure(False)
        assert type(kernels.rms_norm(x, w, 1e-6).grad_fn).__name__ != "_NormBackward"
    finally:
        kernels.configure(True)


def test_unsupported_inputs_fall_back_to_the_reference():
    x = randn(4, 64)  # float64: no kernel
    w = torch.ones(64, device=DEVICE, dtype=torch.float64)
    torch.testing.assert_close(fused.layer_norm(x, w, None, 1e-5), reference.layer_norm(x, w, None, 1e-5))
    t = randn(4, 2, 3, 8).float()
    per_batch = torch.rand(4, 2, 1, 8, device=DEVICE)  # freqs differing by batch entry
    torch.testing.assert_close(fused.apply_rotary_pos_emb(t, per_batch), reference.apply_rotary_pos_emb(t, per_batch))
