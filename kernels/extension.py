"""Finds, or builds on first use, the CUDA extension compiled from ``csrc/``.

Order: the extension ``setup.py`` built (``megatron_lite.kernels._fused_cuda``); else
a just-in-time build with ``torch.utils.cpp_extension`` for this GPU's architecture;
else None, and the ops fall back to PyTorch. Nothing is attempted without a CUDA
PyTorch and a visible GPU, so CPU machines never touch a compiler.

The JIT build is the step Megatron users most often see hang: every rank of a node
starts compiling, or a rank killed mid-build leaves a lock file that blocks all later
runs. Here the first process to take an ``flock`` builds (the kernel drops the lock
if that process dies, so no lock goes stale), in a subprocess with a timeout; the
other processes wait on the same lock, then load what it built or give up after the
timeout and fall back to PyTorch with a warning.
"""
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PREBUILT_MODULE = "megatron_lite.kernels._fused_cuda"
JIT_MODULE = "megatron_lite_fused_cuda"
CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"

BUILD_ENV_VAR = "MEGATRON_LITE_BUILD_KERNELS"
BUILD_DIR_ENV_VAR = "MEGATRON_LITE_KERNELS_BUILD_DIR"
TIMEOUT_ENV_VAR = "MEGATRON_LITE_KERNELS_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0

_LOCK_FILE = "megatron_lite.lock"
_DONE_FILE = "built.json"
_FAILED_FILE = "failed.log"

_module = None
_searched = False


def load():
    """Returns the extension module, or None where the fused CUDA path is unavailable.

    The first call may build the extension (see the module docstring); later calls
    return the cached answer.
    """
    global _module, _searched
    if not _searched:
        _searched = True
        _module = _find_or_build()
    return _module


def _find_or_build():
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module(PREBUILT_MODULE)
    except ImportError:
        pass
    if os.environ.get(BUILD_ENV_VAR) == "0":
        logger.info("fused kernels are not built and %s=0 disables the JIT build", BUILD_ENV_VAR)
        return None
    from torch.utils.cpp_extension import CUDA_HOME

    sources = sorted(CSRC_DIR.glob("*.cu")) + sorted(CSRC_DIR.glob("*.cpp"))
    if CUDA_HOME is None or not sources:
        warnings.warn(
            "megatron_lite fused kernels unavailable: "
            + ("no CUDA toolkit found (set CUDA_HOME)" if sources else f"no sources in {CSRC_DIR}")
            + "; using the PyTorch implementations"
        )
        return None
    major, minor = torch.cuda.get_device_capability()
    cuda_flags = ["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    build_dir = _build_dir(sources, cuda_flags)
    timeout = float(os.environ.get(TIMEOUT_ENV_VAR, DEFAULT_TIMEOUT_S))

    def build(directory, time_left):
        return _jit_build(directory, sources, cuda_flags, time_left)

    library = build_or_wait(build_dir, build, timeout)
    if library is None:
        return None
    try:
        return _import_library(library)
    except (ImportError, OSError) as error:
        _warn(f"could not load {library} ({error}); delete {build_dir} to rebuild")
        return None


def _build_dir(sources, cuda_flags):
    """A directory keyed by everything the binary depends on, so no stale build is reused."""
    key = hashlib.sha256()
    headers = sorted(CSRC_DIR.glob("*.h")) + sorted(CSRC_DIR.glob("*.cuh"))  # a new header counts too
    for path in sources + headers:
        key.update(path.name.encode())
        key.update(path.read_bytes())
    key.update(" ".join(cuda_flags + [torch.__version__, sys.version]).encode())
    root = os.environ.get(BUILD_DIR_ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_lite", "kernels"
    )
    return Path(root) / key.hexdigest()[:16]


def build_or_wait(build_dir, build, timeout):
    """Builds into ``build_dir`` once across processes; the others wait for that build.

    Args:
        build_dir: directory shared by every process that needs this build.
        build: ``build(build_dir, seconds_left) -> path`` of the shared library;
            raises ``subprocess.CalledProcessError`` when compilation fails and
            ``subprocess.TimeoutExpired`` when it runs out of time.
        timeout: seconds any process may spend waiting plus building.

    Returns:
        The library's path, or None (with a warning) when the build failed, an earlier
        build in ``build_dir`` failed, or the timeout passed.
    """
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(build_dir / _LOCK_FILE, "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _warn(f"waited {timeout:.0f}s for another process building them in {build_dir}; "
                          f"raise {TIMEOUT_ENV_VAR} if builds take longer")
                    return None
                time.sleep(0.5)
        try:
            return _build_locked(build_dir, build, deadline)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_locked(build_dir, build, deadline):
    done, failed = build_dir / _DONE_FILE, build_dir / _FAILED_FILE
    if done.exists():
        return Path(json.loads(done.read_text())["library"])
    if failed.exists():
        _warn(f"an earlier build failed (log: {failed}); delete {build_dir} to retry")
        return None
    try:
        library = Path(build(build_dir, max(deadline - time.monotonic(), 1.0)))
    except subprocess.TimeoutExpired:
        _warn(f"the build in {build_dir} timed out; raise {TIMEOUT_ENV_VAR} if builds take longer")
        return None
    except subprocess.CalledProcessError as error:
        failed.write_text(str(error.output or error))
        _warn(f"the build failed (log: {failed}); delete {build_dir} to retry")
        return None
    done.write_text(json.dumps({"library": str(library)}))
    return library


def _jit_build(build_dir, sources, cuda_flags, time_left):
    """Compiles in a subprocess, so a stuck compiler can be killed at the deadline."""
    # torch's own build lock: a leftover from a builder killed mid-build would block
    # this build forever; our flock guarantees no one else is building now.
    (build_dir / "lock").unlink(missing_ok=True)
    spec = {
        "name": JIT_MODULE,
        "sources": [str(s) for s in sources],
        "extra_include_paths": [str(CSRC_DIR)],
        "extra_cflags": ["-O3"],
        "extra_cuda_cflags": cuda_flags,
        "build_directory": str(build_dir),
        "verbose": True,
        "is_python_module": True,
    }
    code = "import json, sys, torch.utils.cpp_extension as c; c.load(**json.loads(sys.argv[1]))"
    logger.info("building megatron_lite fused kernels in %s (one process per build dir)", build_dir)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=time_left,
    )
    (build_dir / "build.log").write_text(result.stdout)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, "torch.utils.cpp_extension.load",
                                            output=result.stdout[-4000:])
    logger.info("built megatron_lite fused kernels in %.0f s", time.monotonic() - start)
    return build_dir / f"{JIT_MODULE}.so"


def _import_library(path):
    spec = importlib.util.spec_from_file_location(JIT_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warn(problem):
    warnings.warn(f"megatron_lite fused kernels: {problem}; using the PyTorch implementations",
                  stacklevel=3)
