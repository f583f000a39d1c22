"""Saying that a run is a restart of its job, and why: in-job restarts (``torchrun --max-restarts N``) and
SLURM requeues.

When a worker dies, torchrun stops every other worker of the job and starts all of them again (up to
``--max-restarts`` times) with a new rendezvous, so the process groups and their port are built anew; a
requeued SLURM job starts again with the same id. Either way the command line is the same, so the run
resumes from the newest checkpoint of ``--load`` (the run plan's), with its data position and random
states: the losses go on as an uninterrupted run's. This module only reads what the launchers set
(``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``SLURM_RESTART_COUNT``) for the log line
that says so, since a restarted job that does not say it is one looks like a run that lost progress.
"""
from __future__ import annotations

import os


def describe_restart(checkpoint: tuple[str, int, bool] | None, environ=os.environ) -> str | None:
    """The log line of a restarted job (None for a first attempt); ``checkpoint`` is the run plan's."""
    torchrun = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    slurm = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if torchrun == 0 and slurm == 0:
        return None
    if torchrun:
        allowed = environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        attempt = (f"restart {torchrun} of at most {allowed} (torchrun --max-restarts): a worker of the previous "
                   f"attempt failed, and torchrun stopped the others (its log names the rank and its exit code or "
                   f"signal)")
    else:
        attempt = f"SLURM requeue {slurm} of job {environ.get('SLURM_JOB_ID', '?')} (preempted, or requeued on a stop)"
    if checkpoint is None or checkpoint[2]:
        return f" {attempt}; no checkpoint of its own in --load yet: training starts again from its beginning"
    root, iteration, _ = checkpoint
    return f" {attempt}; resuming from iteration {iteration} of --load {root}"
