"""No unused imports or names, no undefined names, lines within 120 characters (ruff)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_passes():
    result = subprocess.run(["ruff", "check", "--no-cache", "--select", "E,W,F", "--line-length", "120",
                             "megatron_lite", "kernels", "tools", "bench", "tests", "setup.py"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
