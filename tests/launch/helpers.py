"""Running the launch scripts under stand-in SLURM commands (tests/launch/fake_slurm)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPTS = REPO / "launch_scripts"
FAKE_SLURM_BIN = Path(__file__).resolve().parent / "fake_slurm"

# Variables a launcher may have left in the test's own environment; the scripts must see only ours.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                       "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "TORCHELASTIC_RUN_ID")


def script_env(state_dir: Path, **variables) -> dict:
    """The test process's environment without launcher or SLURM variables, plus the fakes on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_")) and k not in _LAUNCHER_VARIABLES}
    state_dir.mkdir(parents=True, exist_ok=True)
    env.update(PATH=f"{FAKE_SLURM_BIN}{os.pathsep}{env['PATH']}", FAKE_SLURM_DIR=str(state_dir),
               CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)  # the interpreter running the tests has megatron_lite
    env.update({k: str(v) for k, v in variables.items()})
    return env


def slurm_job_env(state_dir: Path, *, nodes: int, tasks_per_node: int, **variables) -> dict:
    """What sbatch sets in the batch shell of a job of ``nodes`` x ``tasks_per_node`` (hosts 127.0.0.x)."""
    return script_env(state_dir, SLURM_JOB_ID=4242, SLURM_JOB_NAME="megatron_lite",
                      SLURM_JOB_NODELIST=f"127.0.0.[1-{nodes}]" if nodes > 1 else "127.0.0.1",
                      SLURM_JOB_NUM_NODES=nodes, SLURM_NNODES=nodes, SLURM_NTASKS_PER_NODE=tasks_per_node,
                      SLURM_NTASKS=nodes * tasks_per_node, SLURM_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})",
                      SLURM_SUBMIT_DIR=str(REPO), SLURM_CPUS_ON_NODE=2, **variables)


def run_script(name: str, env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH_SCRIPTS / name), *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def parse_rank_map(stdout: str) -> list[tuple]:
    """(rank, node, local_rank, tp, pp, dp, cp) rows of the dry run's table."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "node"]) + 1
    rows = []
    for line in lines[start:]:
        fields = line.split()
        if len(fields) != 7 or not fields[0].isdigit():
            break
        rows.append((int(fields[0]), fields[1], *map(int, fields[2:])))
    return rows
