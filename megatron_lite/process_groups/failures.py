"""How a job fails: once, on every rank, with one clean message.

A rank that fails alone would leave the others waiting in a collective; a user error
printed by every rank buries the one line that matters under copies and tracebacks.
``run_on_every_rank`` makes the ranks agree that a step failed and which rank reports
it; ``run_command`` is how every command ends: a user error (``config.UserError``)
prints once as ``error: ...`` and exits 2 (or the error's ``exit_code``), the other ranks exit quietly with the same
code, a bug keeps its traceback, Ctrl-C prints one line, and the process groups are
torn down before the interpreter exits (a gloo group left alive at exit can abort the
process with "terminate called without an active exception").
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_lite.config import UserError
from megatron_lite.process_groups import collectives

USER_ERROR_EXIT_CODE = 2
BUG_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports Ctrl-C
QUIET_RANK_EXIT_DELAY_S = 10.0


class FailedOnAnotherRank(RuntimeError):
    """Raised on every rank but one when a step failed: that one rank reports the error.

    ``user_error`` says whether the failure was the user's (``config.UserError``), so a
    command exits with the same code on every rank (``exit_code``: the error's own, or 2), and prints the
    message only once.
    """

    def __init__(self, message: str, *, failed_rank: int, user_error: bool, exit_code: int = USER_ERROR_EXIT_CODE):
        super().__init__(message)
        self.failed_rank = failed_rank
        self.user_error = user_error
        self.exit_code = exit_code


def run_on_every_rank(fn, what: str):
    """Run ``fn`` on every rank of the world; if any rank raises, every rank raises.

    A rank that fails alone would leave the others waiting in their next collective
    until a timeout. Here the lowest failing rank re-raises its own error and every
    other rank raises ``FailedOnAnotherRank("rank R failed to {what}; ...")``, so the
    job reports the failure once. One all-reduce, also when nothing fails.
    """
    error, result = None, None
    try:
        result = fn()
    except Exception as caught:  # noqa: BLE001 - re-raised below, after the ranks agree
        error = caught
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return result
    world, rank = dist.get_world_size(), dist.get_rank()
    # MAX of (world - rank) finds the lowest failing rank; MAX of the flag whether any failure was a user error,
    # and of its exit code (a user error may carry its own, as a failed result validation does).
    flags = torch.tensor([world - rank if error is not None else 0, int(isinstance(error, UserError)),
                          _user_error_exit_code(error) if isinstance(error, UserError) else 0],
                         device=collectives.reduction_device([dist.group.WORLD]))
    collectives.all_reduce(flags, dist.group.WORLD, op=dist.ReduceOp.MAX)
    lowest, user_error, exit_code = int(flags[0].item()), bool(flags[1].item()), int(flags[2].item())
    if lowest == 0:
        return result
    failed_rank = world - lowest
    if failed_rank == rank:
        error.reported_by_this_rank = True  # run_command prints it here, whatever this rank's number
        raise error
    raise FailedOnAnotherRank(f"rank {failed_rank} failed to {what}; its error message says why.",
                              failed_rank=failed_rank, user_error=user_error,
                              exit_code=exit_code or USER_ERROR_EXIT_CODE)


def _user_error_exit_code(error: UserError) -> int:
    return getattr(error, "exit_code", USER_ERROR_EXIT_CODE)


def global_rank() -> int:
    """This process's rank, also before torch.distributed is initialised (torchrun's and SLURM's variables)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def run_command(body, *args) -> int:
    """Run a command's ``body(*args)`` and return its exit code (see the module docstring)."""
    try:
        # The body's result (a run's model chunks, holding process groups) is dropped here, before the
        # teardown below: alive, it would keep the groups' gloo threads running into interpreter shutdown.
        return _exit_code(body(*args))
    except FailedOnAnotherRank as error:
        _leave_after_the_reporting_rank()
        return error.exit_code if error.user_error else BUG_EXIT_CODE
    except UserError as error:
        # Raised alone (run_on_every_rank picked this rank), or by every rank alike: rank 0 speaks for them.
        if global_rank() == 0 or getattr(error, "reported_by_this_rank", False):
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:
            _leave_after_the_reporting_rank()
        return _user_error_exit_code(error)
    except KeyboardInterrupt:
        if global_rank() == 0:
            print("interrupted (Ctrl-C); nothing was saved since the last checkpoint "
                  "(--exit-signal-handler saves on SIGINT and SIGTERM)", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    finally:
        destroy_process_groups()


def _exit_code(status) -> int:
    """A tool's body may return its own verdict (loss_parity's 1 for a ladder above --rtol); anything else is 0."""
    return status if isinstance(status, int) else 0


def _leave_after_the_reporting_rank() -> None:
    """A launcher stops the whole job as soon as one rank exits with an error: a quiet rank that left
    first would get the reporting rank killed before it printed, and be named the root cause. So a
    quiet rank waits for the launcher to stop it (torchrun and ``srun --kill-on-bad-exit`` do, once the
    reporting rank has exited), and leaves by itself only after a while."""
    time.sleep(QUIET_RANK_EXIT_DELAY_S)


def destroy_process_groups() -> None:
    """Tear down torch.distributed in order, so the interpreter never exits with a live group.

    A launcher stops the other ranks with SIGTERM as soon as one exits non-zero; a rank hit by it
    in the middle of tearing down gloo's threads can abort ("terminate called without an active
    exception"). The teardown is short, so SIGTERM waits for it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    # Objects in reference cycles (module hooks) may still hold groups: collect them first, so the groups
    # are destroyed with their threads now rather than at interpreter shutdown.
    gc.collect()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGTERM, previous)
