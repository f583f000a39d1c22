"""Chooses, per op and per call, which implementation runs.

The rule: our CUDA extension when it is built and the tensors are on CUDA; else
apex when it is installed and offers the op; else the PyTorch reference. An op whose
extension kernel measured slower than another implementation (``SLOWER_KERNELS``)
runs that one instead. Under ``torch.compile`` the reference is always used: Inductor
fuses it into its own kernels, and an opaque extension call would only break the graph.
"""
import logging
import os

import torch

from . import fused

logger = logging.getLogger(__name__)

DISABLE_ENV_VAR = "MEGATRON_LITE_NO_FUSED_KERNELS"

_use_fused = True
_logged = set()

# Ops whose extension kernel ``bench/bench_kernels.py`` (run by tools/gpu_check.sh) measured slower, forward and
# backward, than apex's or the PyTorch reference on a GPU, and which of the two runs instead ("apex" falls back to
# the reference without apex). An op not listed was fastest with the extension wherever it was measured.
SLOWER_KERNELS: dict = {}


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


def choose(op, tensor, reference_impl, apex_impl=None):
    """Returns the implementation of ``op`` to run on ``tensor``.

    Args:
        op: op name: the function of that name in ``fused`` is our CUDA implementation.
        tensor: the op's main input; only CUDA tensors take a fused path.
        reference_impl: the PyTorch reference.
        apex_impl: zero-argument callable returning apex's implementation or None.
    """
    if torch.compiler.is_compiling():
        return reference_impl
    backend, impl = "pytorch", reference_impl
    if tensor.is_cuda and fused_enabled():
        instead = SLOWER_KERNELS.get(op)
        if instead is None and fused.available():
            backend, impl = "cuda extension", getattr(fused, op)
        elif instead != "pytorch" and apex_impl is not None and (apex_op := apex_impl()) is not None:
            backend, impl = "apex", apex_op
    if (op, backend) not in _logged:
        _logged.add((op, backend))
        logger.info("megatron_lite.kernels: %s uses the %s implementation", op, backend)
    return impl
