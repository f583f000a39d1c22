"""Fused ops for the transformer, each with one dispatch rule (see ``dispatch.py``).

The model calls only these functions. Each runs our CUDA kernel when the extension
is built and the tensors are on CUDA, else apex's kernel when apex offers the op,
else the PyTorch reference in ``reference.py`` (which defines the semantics).
"""

if __name__ == "kernels":
    # This folder was imported as a top-level ``kernels``: the checkout's root is on sys.path (``python -m``
    # or pytest run from it), and the import was meant for Hugging Face's ``kernels`` package, which
    # transformers imports whenever it is installed. Hand it over (see top_level.py).
    from .top_level import hand_over_to_installed_package

    hand_over_to_installed_package(__file__)
else:
    from .ops import *  # noqa: F401,F403 (the model calls megatron_lite.kernels.<op>)
    from .ops import __all__  # noqa: F401
