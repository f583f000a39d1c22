"""Finding or building the CUDA extension: never without CUDA; one builder at a time."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from megatron_lite.kernels import extension

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(extension, "_searched", False)
    monkeypatch.setattr(extension, "_module", None)

    def no_build(*args, **kwargs):
        pytest.fail("no build may be attempted here")

    monkeypatch.setattr(extension, "build_or_wait", no_build)


def test_no_build_without_cuda(fresh_loader, monkeypatch):
    # This machine has no GPU; pretend even a CUDA PyTorch is installed.
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert extension.load() is None


def test_build_switched_off_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(extension.BUILD_ENV_VAR, "0")
    assert extension.load() is None


def test_missing_toolkit_warns_and_falls_back(fresh_loader, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(extension.BUILD_ENV_VAR, raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.warns(UserWarning, match="no CUDA toolkit"):
        assert extension.load() is None


def test_jit_build_targets_this_gpu_in_a_keyed_directory(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(extension, "_searched", False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.delenv(extension.BUILD_ENV_VAR, raising=False)
    monkeypatch.setenv(extension.BUILD_DIR_ENV_VAR, str(tmp_path))
    monkeypatch.setenv(extension.TIMEOUT_ENV_VAR, "42")
    seen = {}

    def fake_build_or_wait(build_dir, build, timeout):
        seen.update(build_dir=build_dir, timeout=timeout)
        return None

    monkeypatch.setattr(extension, "build_or_wait", fake_build_or_wait)
    assert extension.load() is None
    assert seen["build_dir"].parent == tmp_path and seen["timeout"] == 42.0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    other_arch = extension._build_dir(sorted(extension.CSRC_DIR.glob("*.cu")), ["sm_80"])
    assert other_arch != seen["build_dir"]


def test_builds_once_then_reuses(tmp_path):
    builds = []

    def build(build_dir, seconds_left):
        builds.append(seconds_left)
        library = build_dir / "lib.so"
        library.write_text("binary")
        return library

    first = extension.build_or_wait(tmp_path, build, timeout=30)
    second = extension.build_or_wait(tmp_path, build, timeout=30)
    assert first == second == tmp_path / "lib.so" and len(builds) == 1
    assert 0 < builds[0] <= 30
    assert json.loads((tmp_path / "built.json").read_text())["library"] == str(first)


def test_failed_build_is_remembered_until_the_directory_is_deleted(tmp_path):
    calls = []

    def failing_build(build_dir, seconds_left):
        calls.append(1)
        raise subprocess.CalledProcessError(1, "nvcc", output="error: expected a ';'")

    with pytest.warns(UserWarning, match="build failed"):
        assert extension.build_or_wait(tmp_path, failing_build, timeout=30) is None
    assert "expected a ';'" in (tmp_path / "failed.log").read_text()
    with pytest.warns(UserWarning, match="earlier build failed"):
        assert extension.build_or_wait(tmp_path, failing_build, timeout=30) is None
    assert len(calls) == 1


def test_timed_out_build_is_not_remembered(tmp_path):
    def slow_build(build_dir, seconds_left):
        raise subprocess.TimeoutExpired("nvcc", seconds_left)

    with pytest.warns(UserWarning, match="timed out"):
        assert extension.build_or_wait(tmp_path, slow_build, timeout=5) is None
    assert not (tmp_path / "failed.log").exists() and not (tmp_path / "built.json").exists()


def _start_builder(build_dir, build_seconds):
    """A process that calls build_or_wait with a build that takes build_seconds."""
    code = textwrap.dedent(f"""
        import pathlib, sys, time
        from megatron_lite.kernels.extension import build_or_wait

        def build(build_dir, seconds_left):
            (build_dir / "started").touch()
            time.sleep({build_seconds})
            with open(build_dir / "builds", "a") as f:
                f.write("x")
            (build_dir / "lib.so").write_text("binary")
            return build_dir / "lib.so"

        print(build_or_wait(pathlib.Path(sys.argv[1]), build, timeout=60))
    """)
    return subprocess.Popen([sys.executable, "-c", code, str(build_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


def _wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_concurrent_processes_build_once(tmp_path):
    processes = [_start_builder(tmp_path, build_seconds=1) for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert outputs == [str(tmp_path / "lib.so")] * 3
    assert (tmp_path / "builds").read_text() == "x"


def test_waiters_give_up_after_the_timeout(tmp_path):
    builder = _start_builder(tmp_path, build_seconds=60)
    try:
        _wait_for(tmp_path / "started")
        with pytest.warns(UserWarning, match="waited 1s for another process"):
            assert extension.build_or_wait(tmp_path, lambda *a: pytest.fail("built"), timeout=1) is None
    finally:
        builder.kill()
        builder.wait()


def test_a_killed_builder_leaves_no_stale_lock(tmp_path, monkeypatch):
    builder = _start_builder(tmp_path, build_seconds=60)
    _wait_for(tmp_path / "started")
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()

    def build(build_dir, seconds_left):
        (build_dir / "lib.so").write_text("binary")
        return build_dir / "lib.so"

    # The dead builder's lock went with it: the lock is taken at once, never waited for.
    monkeypatch.setattr(extension.time, "sleep", lambda seconds: pytest.fail("waited for a lock nobody holds"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert extension.build_or_wait(tmp_path, build, timeout=10) == tmp_path / "lib.so"


def test_jit_build_clears_torchs_leftover_lock_and_reports_failure(monkeypatch, tmp_path):
    (tmp_path / "lock").write_text("")  # torch's FileBaton left by a killed build

    def fake_run(command, **kwargs):
        assert not (tmp_path / "lock").exists()
        assert kwargs["timeout"] == 12.0
        spec = json.loads(command[-1])
        assert spec["build_directory"] == str(tmp_path) and spec["extra_cuda_cflags"] == ["-O3"]
        return subprocess.CompletedProcess(command, 1, stdout="nvcc fatal: bad flag")

    monkeypatch.setattr(extension.subprocess, "run", fake_run)
    with pytest.raises(subprocess.CalledProcessError) as error:
        extension._jit_build(tmp_path, [tmp_path / "a.cu"], ["-O3"], 12.0)
    assert "bad flag" in error.value.output
    assert (tmp_path / "build.log").read_text() == "nvcc fatal: bad flag"
