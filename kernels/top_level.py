"""When this folder is imported under the wrong name.

The folder is installed as ``megatron_lite.kernels`` (setup.py's ``package_dir``), but from a checkout's root
(``python -m megatron_lite.pretrain_gpt``, ``python -m pytest``, a bench script) the root is on ``sys.path``
and a plain ``import kernels`` finds this folder first. That import belongs to Hugging Face's ``kernels``
package, which transformers imports at start whenever it is installed (transformers 5 requires it): without
this hand-over, every use of transformers from a checkout fails with "cannot import name ... from 'kernels'".
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over_to_installed_package(init_file: str) -> None:
    """Puts the installed ``kernels`` package (found on ``sys.path`` without this checkout's root) in
    ``sys.modules["kernels"]``, where the import that reached this folder picks it up. Without one, this
    folder stays what ``kernels`` names (nothing then imports it under that name but by mistake)."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop(__name__, None)  # this module is ours, not a submodule of the package taking the name
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
