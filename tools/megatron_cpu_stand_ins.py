"""What Megatron-LM asks of CUDA, and of packages with CUDA kernels, answered on a CPU: CUDA's RNG-state calls,
``synchronize`` and current device become the CPU ones or no-ops (``cpu_stand_ins``), the legacy model's
LayerNorm gets torch's layer norm in place of apex's CUDA kernel, the legacy GroupedMLP torch's matrix products
in place of ``grouped_gemm``, and Megatron-LM's main an inert triton module and ``typing.override``
(``triton_stand_in``). Each is called in the process that then imports Megatron-LM: by
``megatron_fixture_worker.py`` (the fixtures of ``make_megatron_fixtures.py``) and by
``bench/megatron_core_iteration.py``.
"""
from __future__ import annotations

import os
import sys
import types


def cpu_stand_ins() -> None:
    """What Megatron asks of CUDA that a CPU run answers: RNG states, synchronisation, the device."""
    import torch
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embeddings' first all-reduce moves them there
    torch.cuda.current_device = lambda: "cpu"  # where Megatron's global memory buffer allocates
    # validate_args asks for the GPU generation to decide whether to require CUDA_DEVICE_MAX_CONNECTIONS.
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="cpu")
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # --moe-grouped-gemm asks for sm80 or later
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    # Tensors created on device "cuda": load_checkpoint's all-reduce of the tracker file's iteration, the
    # schedules' token counts and the optimizer's gradient-norm and overflow buffers.
    for factory in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, factory, _on_cpu(getattr(torch, factory)))


def _on_cpu(factory):
    """``factory`` creating on the CPU what it is asked to create on a CUDA device."""
    def create(*args, device=None, **kwargs):
        return factory(*args, device=None if str(device).startswith("cuda") else device, **kwargs)
    return create


def legacy_model_stand_ins() -> None:
    """The legacy model's LayerNorm (``MixedFusedLayerNorm``) imports apex's CUDA extension
    ``fused_layer_norm_cuda`` and computes with apex's ``fused_layer_norm_affine``: stand-ins that
    compute torch's layer norm, which is what apex's kernel computes."""
    import torch
    sys.modules["fused_layer_norm_cuda"] = types.ModuleType("fused_layer_norm_cuda")
    fused = types.ModuleType("apex.normalization.fused_layer_norm")
    fused.fused_layer_norm_affine = lambda input, weight, bias, normalized_shape, eps=1e-5: \
        torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)
    for name in ("apex", "apex.normalization"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["apex.normalization.fused_layer_norm"] = fused


def grouped_gemm_stand_in() -> None:
    """The legacy GroupedMLP multiplies each expert's tokens by its matrices with the CUDA ``grouped_gemm``
    package's ``ops.gmm(a, b, batch_sizes, trans_b)``: a stand-in computing the same products with torch,
    the rows of ``a`` taken ``batch_sizes[i]`` at a time for group i."""
    import torch

    def gmm(a, b, batch_sizes, trans_b=False):
        rows = torch.split(a, [int(n) for n in batch_sizes])
        return torch.cat([r @ (w.t() if trans_b else w) for r, w in zip(rows, b)])

    module = types.ModuleType("grouped_gemm")
    module.ops = types.SimpleNamespace(gmm=gmm)
    sys.modules["grouped_gemm"] = module


def triton_stand_in() -> None:
    """Megatron-LM's main imports triton unconditionally (its MoE paged-stash kernels, which the pipeline
    schedules import), though no triton kernel runs on this path: inert modules whose decorators return the
    function unchanged. torch asks once whether triton is installed and keeps the answer: asked first, it
    keeps to its CPU paths."""
    import importlib.machinery

    import torch.utils._triton
    torch.utils._triton.has_triton_package()

    class Inert:
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Inert()

        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Inert()

    # Megatron-LM's main also asks for Python >= 3.12, of which this path uses only typing.override (an
    # identity decorator); torch's CPU wheel at hand is for Python 3.11.
    import typing
    if not hasattr(typing, "override"):
        typing.override = lambda function: function
    for name in ("triton", "triton.language"):
        module = types.ModuleType(name)
        module.__getattr__ = Inert().__getattr__
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__version__ = "3.0.0"  # what version checks parse
        sys.modules[name] = module
