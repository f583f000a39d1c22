"""In-job restart: under ``torchrun --max-restarts 1`` a worker killed with SIGKILL at a random moment makes
torchrun restart the job, which says so and resumes from the newest checkpoint with the uninterrupted run's
losses (dropout on: the random states resume too)."""
import json
import os
import random
import subprocess
import sys
import time

import psutil

from megatron_lite.checkpointing import storage
from megatron_lite.pretrain_gpt import main
from megatron_lite.process_groups.initialize import free_local_port
from tests.distributed import run_command_on_ranks
from tests.launch.helpers import REPO, script_env

ITERS = 8
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "128", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--train-iters", str(ITERS), "--eval-iters", "0", "--lr", "1e-3", "--no-log-memory", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save-interval", "1", "--async-save"]


def _final_losses(root: str) -> list:
    directory = storage.checkpoint_dir(root, storage.read_latest_iteration(root))
    with open(os.path.join(directory, storage.METADATA_FILE)) as f:
        return json.load(f)["training_state"]["losses"]


def test_a_killed_worker_restarts_the_job_which_resumes_exactly(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    reference, root = str(tmp_path / "reference"), str(tmp_path / "ckpt")
    codes = [code for code, _ in run_command_on_ranks(main, [*FLAGS, "--save", reference], 2)]
    assert codes == [0, 0]

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_local_port()}",
               "-m", "megatron_lite.pretrain_gpt", *FLAGS, "--save", root, "--load", root]
    env = script_env(tmp_path / "env", OMP_NUM_THREADS=1, PYTHONPATH=str(REPO))
    job = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while storage.read_latest_iteration(root) is None and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        workers = [p for p in psutil.Process(job.pid).children()
                   if "megatron_lite.pretrain_gpt" in " ".join(p.cmdline())]
        assert len(workers) == 2, f"seed {seed}: the job ended before the kill (exit code {job.poll()})"
        rng.choice(workers).kill()  # SIGKILL: one worker dies, its writer thread wherever it was
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, f"seed {seed}:\n{output[-4000:]}"
    assert "restart 1 of at most 1 (torchrun --max-restarts)" in output, output[-4000:]
    assert "resuming from iteration" in output
    assert storage.read_latest_iteration(root) == ITERS
    assert _final_losses(root) == _final_losses(reference), f"seed {seed}"
