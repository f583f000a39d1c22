"""The SLURM script end to end on this machine: 2 "nodes" x 2 (or 1) tasks on CPU/gloo.

Stand-in srun/scontrol/scancel (tests/launch/fake_slurm) start the tasks locally
with the variables real srun sets; the nodes are 127.0.0.1 and 127.0.0.2, both
this machine. The training is the real ``python -m megatron_lite.pretrain_gpt``.
"""
import importlib.util
import json
import re
import signal
import subprocess
import time

import pytest

from megatron_lite.process_groups.initialize import free_local_port
from tests.launch.helpers import LAUNCH_SCRIPTS, REPO, slurm_job_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron_lite.pretrain_gpt") is None,
                                reason="the training entry point megatron_lite.pretrain_gpt does not exist yet")

ITERATION = re.compile(r"^ iteration\s+(\d+)/", re.MULTILINE)
TIMEOUT_S = 300  # generous: four ranks importing torch on a shared two-core machine


def latest_iteration(save) -> int:
    return int((save / "latest_checkpointed_iteration.txt").read_text())


def test_srun_mode_trains_and_checkpoints(tmp_path):
    save = tmp_path / "ckpt"
    env = slurm_job_env(tmp_path / "slurm", nodes=2, tasks_per_node=2, CONFIG="tiny", LAUNCH_MODE="srun",
                        TENSOR_MODEL_PARALLEL_SIZE=2, TRAIN_ITERS=4, SAVE=save, SAVE_INTERVAL=2, LOG_INTERVAL=1,
                        MASTER_PORT=free_local_port())
    result = subprocess.run(["bash", str(LAUNCH_SCRIPTS / "pretrain_gpt_slurm.sh")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert [int(i) for i in ITERATION.findall(result.stdout)] == [1, 2, 3, 4], log
    assert latest_iteration(save) == 4
    for iteration in (2, 4):
        metadata = json.loads((save / f"iter_{iteration:07d}" / "metadata.json").read_text())
        assert "tensor_model_parallel_size\": 2" in json.dumps(metadata), metadata.keys()
    assert not (tmp_path / "slurm" / "requeued").exists(), "a finished run must not requeue itself"


class BatchJob:
    """The SLURM script running in the background, its output in a file, as sbatch would run it."""

    def __init__(self, env, log_path):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        self.process = subprocess.Popen(["bash", str(LAUNCH_SCRIPTS / "pretrain_gpt_slurm.sh")], env=env,
                                        cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def iterations(self) -> list[int]:
        return [int(i) for i in ITERATION.findall(self.log())]

    def wait_for_iteration(self, at_least: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not self.iterations() or self.iterations()[-1] < at_least:
            assert self.process.poll() is None, f"the job ended early:\n{self.log()}"
            assert time.monotonic() < deadline, f"no iteration {at_least} within {TIMEOUT_S}s:\n{self.log()}"
            time.sleep(0.2)

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.log_file.close()


def test_sigterm_checkpoints_requeues_and_resumes(tmp_path):
    """SLURM's SIGTERM before the time limit (--signal=B:TERM): checkpoint, requeue, resume from it."""
    save, state = tmp_path / "ckpt", tmp_path / "slurm"
    # One task per node: two ranks on two nodes show every rank stopping together (local ranks are the srun test's).
    env = slurm_job_env(state, nodes=2, tasks_per_node=1, CONFIG="tiny", LAUNCH_MODE="torchrun",
                        TRAIN_ITERS=100000, SAVE=save, SAVE_INTERVAL=100000, LOG_INTERVAL=1,
                        MASTER_PORT=free_local_port())

    first = BatchJob(env, tmp_path / "first.out")
    first.wait_for_iteration(1)
    first.process.send_signal(signal.SIGTERM)  # what SLURM sends the batch shell 120 s before the limit
    first.finish()
    log = first.log()
    stopped_at = latest_iteration(save)
    assert 1 <= stopped_at < 100000, log
    assert first.iterations()[-1] == stopped_at, "every rank stopped at the same iteration, after saving it"
    assert (state / "requeued").read_text().split() == ["4242"], log

    # The requeued job: same job id and variables, SLURM_RESTART_COUNT=1, a fresh step.
    (state / "srun_pids").unlink()
    second = BatchJob(dict(env, SLURM_RESTART_COUNT="1"), tmp_path / "second.out")
    second.wait_for_iteration(stopped_at + 2)
    second.process.send_signal(signal.SIGTERM)
    second.finish()
    log = second.log()
    assert f"resuming from {save} (iteration {stopped_at})" in log
    assert second.iterations()[0] == stopped_at + 1, f"the resumed run restarted elsewhere:\n{log}"
    consumed = re.search(rf"iteration\s+{stopped_at + 1}/.*?consumed samples:\s+(\d+)", log).group(1)
    assert int(consumed) == (stopped_at + 1) * 8, "the data position continues too (global batch 8)"
    assert latest_iteration(save) == second.iterations()[-1] > stopped_at
