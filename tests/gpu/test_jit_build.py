"""The just-in-time build on a real GPU: two processes at once, one compiles, both load.

Slow (a full compile for this GPU's architecture); tools/gpu_check.sh runs it last.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Hides any extension setup.py built, so load() must take the JIT path.
PROCESS = textwrap.dedent("""
    import logging, sys, warnings
    sys.modules["megatron_lite.kernels._fused_cuda"] = None
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    import torch
    from megatron_lite.kernels import extension, fused, reference

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = extension.load()
    problems = [str(w.message) for w in caught if "megatron_lite" in str(w.message)]
    assert module is not None and not problems, problems
    assert module.__name__ == extension.JIT_MODULE, module
    x = torch.randn(37, 1001, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1001, device="cuda", requires_grad=True)
    y = fused.rms_norm(x, w, 1e-6)
    assert type(y.grad_fn).__name__ == "_NormBackward", y.grad_fn
    torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-6), rtol=2e-2, atol=2e-2)
    print("loaded and ran")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_processes_share_one_jit_build(tmp_path):
    env = {**os.environ, "MEGATRON_LITE_KERNELS_BUILD_DIR": str(tmp_path)}
    env.pop("MEGATRON_LITE_BUILD_KERNELS", None)
    processes = [
        subprocess.Popen([sys.executable, "-c", PROCESS], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in processes]
    for p, out in zip(processes, outputs):
        assert p.returncode == 0 and "loaded and ran" in out, out
    builders = [out for out in outputs if "building megatron_lite fused kernels" in out]
    assert len(builders) == 1, outputs
    (build_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert (build_dir / "built.json").exists() and (build_dir / "build.log").exists()
