"""Stop cleanly on a scheduler's signal, on the same iteration on every rank.

SLURM sends SIGTERM shortly before a job's time limit (``#SBATCH --signal``) or
on preemption. The signal reaches ranks at slightly different moments, so a rank
that stopped on its own would leave the others waiting in a collective forever.
The handler only records the signal; once per iteration the training loop asks
``signals_received(parallel_state)``, which all-reduces the flag over the world, so
every rank gets the same answer, saves the same iteration and exits.

    with DistributedSignalHandler() as handler:
        for iteration in ...:
            train_step(...)
            if handler.signals_received(parallel_state):
                save_checkpoint(...)
                break
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives


class DistributedSignalHandler:
    """Context manager that records its signals instead of dying, and restores the old handlers on exit.

    By default SIGTERM (the scheduler's) and SIGINT (Ctrl-C, which a terminal sends to every rank
    of a torchrun job): both save the checkpoint and exit, as ``--exit-signal-handler`` promises.
    """

    def __init__(self, *signals: signal.Signals):
        self.signals = signals or (signal.SIGTERM, signal.SIGINT)
        self._received = False
        self._previous = {}

    def __enter__(self) -> "DistributedSignalHandler":
        self._received = False
        self._previous = {sig: signal.signal(sig, self._record) for sig in self.signals}
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _record(self, signum, frame) -> None:
        self._received = True

    def signals_received(self, parallel_state) -> bool:
        """Whether any rank of the job has received the signal; a collective, so call it on every rank.

        Args:
            parallel_state: this rank's ``ParallelState``; the flag is reduced over its
                whole world (no communication for a single process).
        """
        group = dist.group.WORLD if parallel_state.world_size > 1 else None
        flag = torch.tensor([int(self._received)], dtype=torch.int32,
                            device=collectives.reduction_device([group]))
        collectives.all_reduce(flag, group, op=dist.ReduceOp.MAX)
        return bool(flag.item())
