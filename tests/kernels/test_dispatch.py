"""The dispatch rule: CUDA extension, else apex, else the reference; switches; logging."""
import logging
import sys
import types

import pytest
import torch

import megatron_lite.kernels as kernels
from megatron_lite.kernels import apex_ops, dispatch, fused, reference

CUDA_LIKE = types.SimpleNamespace(is_cuda=True)
CPU_LIKE = types.SimpleNamespace(is_cuda=False)


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_use_fused", True)
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.delenv(dispatch.DISABLE_ENV_VAR, raising=False)


def test_cuda_extension_comes_first(monkeypatch):
    monkeypatch.setattr(fused, "available", lambda: True)
    impl = dispatch.choose("layer_norm", CUDA_LIKE, reference.layer_norm, lambda: "apex impl")
    assert impl is fused.layer_norm


def test_apex_when_the_extension_is_missing(monkeypatch):
    monkeypatch.setattr(fused, "available", lambda: False)
    assert dispatch.choose("rms_norm", CUDA_LIKE, reference.rms_norm, lambda: "apex impl") == "apex impl"
    assert dispatch.choose("rms_norm", CUDA_LIKE, reference.rms_norm, lambda: None) is reference.rms_norm
    assert dispatch.choose("swiglu", CUDA_LIKE, reference.swiglu) is reference.swiglu


def test_a_kernel_measured_slower_gives_way(monkeypatch):
    """SLOWER_KERNELS names the implementation to run instead of a slower extension kernel."""
    monkeypatch.setattr(fused, "available", lambda: True)
    monkeypatch.setattr(dispatch, "SLOWER_KERNELS", {"rms_norm": "apex", "layer_norm": "pytorch"})
    assert dispatch.choose("rms_norm", CUDA_LIKE, reference.rms_norm, lambda: "apex impl") == "apex impl"
    assert dispatch.choose("rms_norm", CUDA_LIKE, reference.rms_norm, lambda: None) is reference.rms_norm
    assert dispatch.choose("layer_norm", CUDA_LIKE, reference.layer_norm, lambda: "apex impl") is reference.layer_norm
    assert dispatch.choose("swiglu", CUDA_LIKE, reference.swiglu) is fused.swiglu


def test_cpu_tensors_always_take_the_reference(monkeypatch):
    monkeypatch.setattr(fused, "available", lambda: pytest.fail("CPU tensors must not load the extension"))
    assert dispatch.choose("layer_norm", CPU_LIKE, reference.layer_norm, lambda: "apex") is reference.layer_norm


def test_configure_and_environment_variable_force_the_reference(monkeypatch):
    monkeypatch.setattr(fused, "available", lambda: True)
    kernels.configure(False)
    assert not kernels.fused_enabled()
    assert dispatch.choose("bias_gelu", CUDA_LIKE, reference.bias_gelu) is reference.bias_gelu
    kernels.configure(True)
    monkeypatch.setenv(dispatch.DISABLE_ENV_VAR, "1")
    assert not kernels.fused_enabled()
    assert dispatch.choose("bias_gelu", CUDA_LIKE, reference.bias_gelu) is reference.bias_gelu
    assert not kernels.load_extension()


def test_torch_compile_traces_the_reference(monkeypatch):
    monkeypatch.setattr(fused, "available", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.choose("swiglu", CUDA_LIKE, reference.swiglu) is reference.swiglu


def test_ops_compile_without_graph_breaks():
    def block(x, w):
        h = kernels.rms_norm(x, w, 1e-6)
        h = kernels.swiglu(torch.cat([h, h], -1))
        return kernels.bias_dropout_add(h, None, x, 0.0, False)

    x, w = torch.randn(4, 8), torch.randn(8)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), block(x, w), rtol=0, atol=0)


def test_choice_is_logged_once_per_op_and_backend(caplog):
    caplog.set_level(logging.INFO, logger=dispatch.logger.name)
    for _ in range(3):
        dispatch.choose("layer_norm", CPU_LIKE, reference.layer_norm)
        dispatch.choose("rms_norm", CPU_LIKE, reference.rms_norm)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "megatron_lite.kernels: layer_norm uses the pytorch implementation",
        "megatron_lite.kernels: rms_norm uses the pytorch implementation",
    ]


def all_ops(x, mask):
    """Every public op once, chained as a transformer layer would use them."""
    hidden = x.shape[-1]
    w = torch.linspace(0.5, 1.5, hidden)
    h = kernels.layer_norm(x, w, torch.zeros(hidden), 1e-5) + kernels.rms_norm(x, w, 1e-6)
    h = kernels.bias_gelu(h, w) + kernels.swiglu(torch.cat([h, x], -1))
    freqs = torch.arange(x.shape[0] * hidden, dtype=torch.float32).view(x.shape[0], 1, 1, hidden)
    q = kernels.apply_rotary_pos_emb(h.view(x.shape[0], x.shape[1], 1, hidden), freqs).flatten(2)
    scores = torch.einsum("sbh,tbh->bst", q, h)
    p1 = kernels.scaled_upper_triang_masked_softmax(scores, 0.5)
    p2 = kernels.scaled_masked_softmax(scores.unsqueeze(1), mask, 0.5).squeeze(1)
    ctx = torch.einsum("bst,tbh->sbh", p1 + p2, h)
    return kernels.bias_dropout_add(ctx, w, x, 0.1, True)


def test_fused_on_and_off_give_identical_results_on_cpu(monkeypatch):
    x = torch.randn(6, 2, 8, requires_grad=True)
    mask = torch.rand(2, 1, 6, 6) < 0.3
    results = []
    for enabled in (True, False):
        kernels.configure(enabled)
        torch.manual_seed(0)
        out = all_ops(x, mask)
        (grad,) = torch.autograd.grad(out.sum(), x)
        results.append((out, grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _install_fake_apex(monkeypatch, calls):
    def layer_norm_affine(x, weight, bias, normalized_shape, eps):
        calls.append(("layer_norm", normalized_shape, eps, weight.dtype, bias.dtype))
        return reference.layer_norm(x, weight, bias, eps)

    def rms_norm_affine(x, weight, normalized_shape, eps):
        calls.append(("rms_norm", normalized_shape, eps, weight.dtype))
        return reference.rms_norm(x, weight, eps)

    def rotary(t, freqs):
        calls.append(("rotary", freqs.dtype))
        return reference.apply_rotary_pos_emb(t, freqs)

    norm_module = types.ModuleType("apex.normalization.fused_layer_norm")
    norm_module.fused_layer_norm_affine = layer_norm_affine
    norm_module.fused_rms_norm_affine = rms_norm_affine
    functional = types.ModuleType("apex.transformer.functional")
    functional.fused_apply_rotary_pos_emb = rotary
    for name, module in {
        "apex": types.ModuleType("apex"),
        "apex.normalization": types.ModuleType("apex.normalization"),
        "apex.normalization.fused_layer_norm": norm_module,
        "apex.transformer": types.ModuleType("apex.transformer"),
        "apex.transformer.functional": functional,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    apex_ops._import.cache_clear()


def test_apex_wrappers_pass_shapes_and_x_dtype_parameters(monkeypatch):
    calls = []
    _install_fake_apex(monkeypatch, calls)
    try:
        x = torch.randn(3, 16, dtype=torch.bfloat16)
        w = torch.ones(16)  # float32 parameters, bfloat16 activations
        torch.testing.assert_close(apex_ops.layer_norm_op()(x, w, None, 1e-5), reference.layer_norm(x, w, None, 1e-5))
        torch.testing.assert_close(apex_ops.rms_norm_op()(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        t = torch.randn(4, 1, 2, 8)
        freqs = torch.randn(4, 1, 1, 8, dtype=torch.float64)
        torch.testing.assert_close(
            apex_ops.rotary_op()(t, freqs), reference.apply_rotary_pos_emb(t, freqs.float())
        )
        bf16 = torch.bfloat16
        assert calls == [("layer_norm", (16,), 1e-5, bf16, bf16), ("rms_norm", (16,), 1e-6, bf16),
                         ("rotary", torch.float32)]
    finally:
        apex_ops._import.cache_clear()


def test_apex_absent_offers_nothing():
    apex_ops._import.cache_clear()
    if apex_ops._import("apex.normalization.fused_layer_norm", "fused_layer_norm_affine") is not None:
        pytest.skip("apex is installed here")
    assert apex_ops.layer_norm_op() is None and apex_ops.rms_norm_op() is None
    assert apex_ops.rotary_op() is None
