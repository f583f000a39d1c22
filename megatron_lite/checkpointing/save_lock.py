"""One run per --save directory: an exclusive lock held while the run trains.

Two runs saving into one directory destroy each other's checkpoints (one commits an empty
``iter_N/`` over the other's, the tracker flips between their iterations). So rank 0 holds
``SAVE/.megatron_lite.lock`` from the first training step to the end: an ``flock`` on the file, which
the kernel drops when the process dies however it dies, so a crashed run's lock never blocks its
restart; the file itself holds who holds it (host, pid, start time, command) for the message a second
run prints. A lock file left by a process that died is taken over with a note naming it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time

from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.process_groups import failures

LOCK_FILE = ".megatron_lite.lock"


class SaveLock:
    """The exclusive lock on one save directory, held by this process until ``release``."""

    def __init__(self, root: str):
        self.path = os.path.join(root, LOCK_FILE)
        self._fd = None

    def acquire(self) -> None:
        """Take the lock; raise CheckpointError naming the holder when another live process has it."""
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CheckpointError(self._in_use_message()) from None
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # the holder released (and removed) the file between our open and flock: try the new one
                os.close(fd)
        previous = _read_holder(self.path)
        if previous:
            print(f"note: {self.path} was left by {_describe(previous)}, which ended without releasing it "
                  f"(killed or crashed); this run takes it over.", file=sys.stderr, flush=True)
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(holder).encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)  # before the unlock, so no one takes over a file that is being removed
        os.close(self._fd)
        self._fd = None

    def _in_use_message(self) -> str:
        root = os.path.dirname(self.path)
        holder = _read_holder(self.path)
        who = _describe(holder) if holder else "another process (it is still starting)"
        return (f"--save {root} is in use by {who}; lock: {self.path}. Two runs saving to one directory destroy "
                f"each other's checkpoints: give this run its own --save, or wait for that run to end. The lock "
                f"is released when its process exits, however it exits; if that process is on another machine "
                f"that is gone, remove {self.path}.")


@contextlib.contextmanager
def holding_save_lock(root: str | None, is_holder: bool):
    """Hold ``root``'s lock for the ``with`` block on the rank that ``is_holder`` (one rank per job); a
    no-op without --save. When the directory is in use, every rank raises (the holder's CheckpointError
    names the other run), so none is left waiting in a collective."""
    lock = SaveLock(root) if root and is_holder else None
    failures.run_on_every_rank(lambda: lock.acquire() if lock is not None else None, f"lock --save {root}")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_holder(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):  # empty (being written) or not ours
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict) -> str:
    return (f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')}: "
            f"{holder.get('command')})")
