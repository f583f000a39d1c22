"""CI's compile check: every csrc/*.cu builds for sm_80 and sm_90 (needs nvcc, no GPU)."""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nvcc():
    toolkit_nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return shutil.which("nvcc") or (toolkit_nvcc if os.path.exists(toolkit_nvcc) else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_every_cuda_source_compiles_for_sm80_and_sm90():
    result = subprocess.run(
        ["bash", os.path.join(REPO, "tools", "compile_kernels_check.sh")],
        env={**os.environ, "NVCC": _nvcc()}, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    sources = sorted(f for f in os.listdir(os.path.join(REPO, "csrc")) if f.endswith(".cu"))
    for source in sources:
        assert f"ok  csrc/{source}" in result.stdout
