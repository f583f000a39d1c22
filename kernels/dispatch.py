"""Chooses, per op and per call, which implementation runs.

The rule: our CUDA extension when it is built and the tensors are on CUDA; else
apex when it is installed and offers the op; else the PyTorch reference. Under
``torch.compile`` the reference is always used: Inductor fuses it into its own
kernels, and an opaque extension call would only break the graph.
"""
import logging
import os

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV_VAR = "MEGATRON_LITE_NO_FUSED_KERNELS"

_use_fused = True
_logged = set()


def configure(use_fused):
    """Enables or disables the fused paths (``--no-fused-kernels`` passes False).

    The environment variable ``MEGATRON_LITE_NO_FUSED_KERNELS=1`` forces the
    PyTorch reference whatever this is set to.
    """
    global _use_fused
    _use_fused = bool(use_fused)


def fused_enabled():
    """True unless ``configure(False)`` or the environment variable turned fusion off."""
    return _use_fused and os.environ.get(DISABLE_ENV_VAR, "0") != "1"


def choose(op, tensor, cuda_impl, apex_impl, reference_impl):
    """Returns the implementation of ``op`` to run on ``tensor``.

    Args:
        op: op name, for the log line.
        tensor: the op's main input; its device decides whether a CUDA path applies.
        cuda_impl: zero-argument callable returning our extension's implementation
            or None when the extension is unavailable (called only for CUDA tensors).
        apex_impl: zero-argument callable returning apex's implementation or None.
        reference_impl: the PyTorch reference.
    """
    if torch.compiler.is_compiling():
        return reference_impl
    backend, impl = "pytorch", reference_impl
    if tensor.is_cuda and fused_enabled():
        for name, get in (("cuda extension", cuda_impl), ("apex", apex_impl)):
            candidate = get() if get is not None else None
            if candidate is not None:
                backend, impl = name, candidate
                break
    if (op, backend) not in _logged:
        _logged.add((op, backend))
        logger.info("megatron_lite.kernels: %s uses the %s implementation", op, backend)
    return impl
