"""Name each rank's last collective when one times out (the groups' timeout: --distributed-timeout-minutes).

A collective that times out says only that it waited (gloo: ``Timed out waiting 600000ms for recv operation``);
the rank that stalled, and where, is on another machine. So while a job runs, a background thread on each rank
publishes that rank's last collective (``collectives.tracker``: operation, group, its number in the group, the
iteration, when it began, whether it returned) to the job's rendezvous store, whenever it changed, every quarter
of the timeout: a store write per period at most, nothing per collective. A rank that stalls stops changing
it, so what the store holds is where it stalled. When a collective fails with a timeout (or because a peer
closed its connection), the rank reads every rank's entry and raises one error naming them, and which ranks
are behind in the group it waited in. The launcher (or a person with the store's address) can read the same
keys: ``megatron_lite/last_collective/<rank>``, JSON.

NCCL's own watchdog aborts a timed-out process from C++ without a Python error; there torch's flight recorder
(TORCH_NCCL_TRACE_BUFFER_SIZE) names the collectives, and the published keys still say where each rank was.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Optional

import torch.distributed as dist

from megatron_lite.config import UserError
from megatron_lite.process_groups import collectives

KEY_PREFIX = "megatron_lite/last_collective/"
# What a collective's error says when it timed out or its peer went away (gloo's words; NCCL's and the store's).
_TIMEOUT_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer")


class CollectiveTimeoutError(UserError, RuntimeError):
    """A collective waited past the groups' timeout, or lost a peer: the message names each rank's
    last collective. Not the user's input, but one line says all there is to say (no traceback helps)."""


class LastCollectivePublisher(threading.Thread):
    """Writes this rank's last collective to the store every ``period_s`` when it changed."""

    def __init__(self, store, rank: int, period_s: float):
        super().__init__(name="megatron_lite-last-collective", daemon=True)
        self.store, self.rank, self.period_s = store, rank, period_s
        self.stopped = threading.Event()
        self.published: Optional[tuple] = None

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            self.publish()

    def publish(self) -> None:
        entry = current_entry()
        if entry is None or (entry["sequence"], entry["returned"], entry["now_in_iteration"]) == self.published:
            return
        try:
            self.store.set(f"{KEY_PREFIX}{self.rank}", json.dumps(entry))
        except (RuntimeError, OSError):  # the store went away (the job ends): nothing left to publish to
            self.stopped.set()
            return
        self.published = (entry["sequence"], entry["returned"], entry["now_in_iteration"])

    def stop(self) -> None:
        self.stopped.set()
        self.join()


@contextlib.contextmanager
def reporting_hangs(timeout_minutes: float, setting: str = "the process groups' timeout"):
    """Publish this rank's last collective while the block runs; a collective timing out inside it raises
    CollectiveTimeoutError naming every rank's (``setting``: what the error calls the timeout, so the caller
    can name its flag). A world of one process has nothing to report."""
    store = _default_store()
    if store is None:
        yield
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    publisher = LastCollectivePublisher(store, rank, period_s=timeout_minutes * 60 / 4)
    publisher.start()
    try:
        yield
    except RuntimeError as error:
        if not is_collective_failure(error):
            raise
        publisher.stop()
        publisher.publish()  # this rank's entry as it is now, for the ranks that report after this one
        raise CollectiveTimeoutError(describe_hang(rank, world_size, store, f"{setting} ({timeout_minutes:g} minutes)",
                                                   str(error))) from error
    finally:
        publisher.stop()
        collectives.tracker.iteration = None


def current_entry() -> Optional[dict]:
    """This rank's last collective as published: the tracker's, the iteration the rank is in now, and how many
    collectives of each group it has issued (to tell who is behind in the group a rank waits in)."""
    tracker = collectives.tracker
    if tracker.last is None:
        return None
    return {**dataclasses.asdict(tracker.last), "now_in_iteration": tracker.iteration,
            "groups": dict(tracker.group_sequences)}


def is_collective_failure(error: BaseException) -> bool:
    return any(sign in str(error).lower() for sign in _TIMEOUT_SIGNS)


def describe_hang(rank: int, world_size: int, store, timeout: str, cause: str) -> str:
    """The error: this rank's collective that failed, every rank's last one, and the ranks behind in its group."""
    entries = {r: _read(store, r) for r in range(world_size)}
    entries[rank] = current_entry()  # this rank's own from memory: the store may be gone
    mine = entries[rank] or {}
    now = time.time()
    waited = f"{mine['op']} #{mine['group_sequence']} of group '{mine['group']}'" if mine else "a collective"
    timed_out = "timed out" in cause.lower() or "timeout" in cause.lower()
    said = cause.strip().splitlines()[0][:160] if cause.strip() else "no message"
    what = f"waited past {timeout} in {waited}" if timed_out else f"lost a peer in {waited}"
    what += f" (the backend said: {said})"
    lines = [_describe_entry(r, entries[r], now) for r in range(world_size)]
    # Behind: fewer collectives of the group this rank waits in than this rank has issued.
    behind = [r for r, e in entries.items() if mine and e is not None
              and e["groups"].get(mine["group"], 0) < mine["group_sequence"]]
    silent = [r for r, e in entries.items() if e is None]
    verdict = ""
    if behind:
        verdict = (f" Rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} never reached it (fewer "
                   f"collectives of group '{mine['group']}'): "
                   f"stalled or hung outside the collective (its last one above) - a slow data loader or disk, "
                   f"a deadlock, or a dead process; look at that rank's log and stack (py-spy dump).")
    if silent:
        verdict += f" Ranks {', '.join(map(str, silent))} published nothing (no collective yet, or gone)."
    return (f"rank {rank} {what}. Each rank's last collective: {'; '.join(lines)}.{verdict} Raise {timeout} "
            f"only if a rank is legitimately that slow (a long save or data build).")


def _describe_entry(rank: int, entry: Optional[dict], now: float) -> str:
    if entry is None:
        return f"rank {rank}: none published"
    where = f", issued in iteration {entry['iteration']}" if entry["iteration"] is not None else ""
    if entry["now_in_iteration"] not in (None, entry["iteration"]):
        where += f"; the rank is in iteration {entry['now_in_iteration']}"
    state = "returned" if entry["returned"] else "not returned"
    return (f"rank {rank}: {entry['op']} #{entry['group_sequence']} of group '{entry['group']}' (collective "
            f"#{entry['sequence']} of the rank{where}), begun {now - entry['started']:.1f} s ago, {state}")


def _read(store, rank: int) -> Optional[dict]:
    key = f"{KEY_PREFIX}{rank}"
    try:
        return json.loads(store.get(key)) if store.check([key]) else None
    except (RuntimeError, OSError, ValueError):  # the store's host is gone: that rank cannot be asked
        return None


def _default_store():
    """The default process group's store, or None for a single process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.distributed_c10d._get_default_store()
