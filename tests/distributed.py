"""Run a test function on N real ``torch.distributed`` ranks (gloo, CPU).

Each rank is a process forked from a forkserver that has already imported torch,
so a world of 8 starts in about a second instead of eight cold imports. Every
rank runs with one intra-op thread on a free TCP port; the whole run has a hard
timeout so a deadlock fails the test instead of hanging CI, and a failing rank's
traceback is raised in the test report.

    def _body(rank, world_size, x):      # module level, so it can be pickled
        ...
        return something_picklable

    results = run_distributed(_body, world_size=4, args=(x,))   # list, one per rank

``run_command_on_ranks(main, argv, world_size)`` runs a command's ``main(argv)`` on every rank, as
torchrun would, and returns each rank's exit code and output: what a user would see, without starting
an interpreter (and importing torch) per rank.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import time
import traceback

import torch.multiprocessing as mp

from megatron_lite.process_groups.initialize import free_local_port

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_LITE_TEST_TIMEOUT", "180"))
GRACE_S = 1.0  # after one rank fails, how long the others get to report before they are killed

_context = mp.get_context("forkserver")
# torch.optim's first step imports torch._dynamo (seconds per rank): preload it once.
# pytest too: every test module imports it, and each rank imports the test module to find fn.
# The trainer (megatron_lite.training.loop and what it imports: the model, the parallel layers, checkpointing)
# is what most rank bodies run: a quarter of a second of CPU per rank otherwise.
_context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pytest", "megatron_lite",
                                 "megatron_lite.training.loop"])


class DistributedTestError(AssertionError):
    pass


def _rank_main(fn, rank, world_size, port, args, kwargs, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle, not torch's shared-memory reduction: a tensor result must outlive this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(fn, world_size: int, args: tuple = (), kwargs: dict | None = None) -> tuple[list, object]:
    """Start ``fn(rank, world_size, *args, **kwargs)`` on every rank and return at once: the processes, and the
    queue receiving (rank, status, pickled result) from each (keep it until they end). For a test that kills
    the job (SIGKILL) at a moment of its choosing."""
    port = free_local_port()
    results = _context.SimpleQueue()
    procs = [_context.Process(target=_rank_main, args=(fn, r, world_size, port, args, kwargs or {}, results),
                              daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, results


def run_distributed(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
    procs, results = start_ranks(fn, world_size, args, kwargs)
    outcome, errors = {}, []
    deadline = time.monotonic() + timeout
    stop_at = deadline  # moved up to GRACE_S after the first failure
    while len(outcome) + len(errors) < world_size and time.monotonic() < stop_at:
        if results.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                stop_at = min(stop_at, time.monotonic() + GRACE_S)
            time.sleep(0.01)
            continue
        rank, status, value = results.get()
        if status == "ok":
            outcome[rank] = pickle.loads(value)
        else:
            # The others may be blocked in a collective: give them a moment to report
            # (their errors help), then stop waiting.
            errors.append((rank, value))
            stop_at = min(stop_at, time.monotonic() + GRACE_S)
    # A rank that died without reporting (segfault, os._exit) is the likely root cause:
    # its siblings' "connection reset" errors are only the consequence.
    reported = set(outcome) | {rank for rank, _ in errors}
    silent = {r: p.exitcode for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)}
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    if silent:
        others = "".join(f"\nthen rank {rank} failed:\n{tb}" for rank, tb in errors)
        raise DistributedTestError(f"ranks {sorted(silent)} of {world_size} exited without a result (exit codes "
                                   f"{silent}): a crash outside Python, or fn or its module not importable.{others}")
    if errors:
        rank, tb = errors[0]
        others = f" (ranks {[r for r, _ in errors[1:]]} failed after it)" if len(errors) > 1 else ""
        raise DistributedTestError(f"rank {rank} of {world_size} failed{others}:\n{tb}")
    missing = sorted(set(range(world_size)) - set(outcome))
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise DistributedTestError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                                   f"(exit codes {codes}): a deadlock, a crash, or a mismatched collective.")
    return [outcome[r] for r in range(world_size)]


def run_command_on_ranks(main, argv: list[str], world_size: int,
                         timeout: float = DEFAULT_TIMEOUT_S) -> list[tuple[int, str]]:
    """(exit code, stdout + stderr) of ``main(argv)`` (a module-level command entry point) on each rank."""
    return run_distributed(_command_on_rank, world_size, args=(main, argv), timeout=timeout)


def _command_on_rank(rank, world_size, main, argv):
    from megatron_lite.process_groups import failures

    # Under torchrun a quiet rank waits to be stopped once the reporting rank has exited; here nothing stops it.
    failures.QUIET_RANK_EXIT_DELAY_S = 0
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = main(argv)
    return code, output.getvalue()
