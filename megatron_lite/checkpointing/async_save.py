"""Saving while training goes on (``--async-save``, Megatron-LM's flag).

    saver = CheckpointSaver(config, parallel_state)
    saver.save(model_chunks, optimizer, scheduler, state)   # the step's part: copy the state to CPU memory
    saver.maybe_finalize()                                  # every iteration: commit once every rank is done
    saver.finalize()                                        # the next save and the end of training wait here

A save has three parts. The copy (``saving.take_snapshot``) reads the live tensors, so it stays in the
training step; writing the copy (serialising, fsyncing, reading it back against its checksum) is most of
a save's time, and goes to a background thread; the commit (rank 0 renames the staging directory and moves
``latest_checkpointed_iteration.txt``) needs every rank's files complete and verified, which the ranks
agree on with one all-reduce of "done" flags per iteration, on the training thread, where every rank
reaches it at the same point (a collective from the worker could interleave with training's own).

Why a thread and not a process (Megatron-LM forks a worker process): the copy is already in this process's
memory, and a process would need it copied again or moved to shared memory; forking a process that runs
gloo's threads is unsafe, and spawning one imports torch (seconds). The worker spends its time in file
writes and SHA-256, which release the GIL. A kill -9 ends the thread with the process, as it would a
child process (whose parent dies with the job): either way the staging directory is left behind, hidden,
the tracker still names the previous checkpoint, and the next save of that iteration replaces the debris.

Without --async-save, ``save`` writes and commits at once (``saving.save_checkpoint``'s order).
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from megatron_lite.checkpointing import saving
from megatron_lite.process_groups import collectives


class _Writer(threading.Thread):
    """Writes one snapshot; keeps the error it met for the ranks to agree on."""

    def __init__(self, snapshot: saving.Snapshot):
        super().__init__(name=f"checkpoint-writer-{snapshot.iteration}", daemon=True)  # a crash must not wait
        self.snapshot = snapshot
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            saving.write_snapshot(self.snapshot)
        except BaseException as error:  # noqa: BLE001 - raised on the training thread, after the ranks agree
            self.error = error

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class CheckpointSaver:
    """The run's saves, synchronous or (``--async-save``) written in the background, one at a time."""

    def __init__(self, config, parallel_state):
        self.config = config
        self.parallel_state = parallel_state
        self.asynchronous = config.checkpoint.async_save
        self._pending: _Writer | None = None

    def save(self, model_chunks, optimizer, scheduler, state) -> None:
        """Save ``state.iteration`` (every rank); a save still in flight is committed first."""
        self.finalize()
        snapshot = saving.take_snapshot(self.config, self.parallel_state, model_chunks, optimizer, scheduler,
                                           state)
        if not self.asynchronous:
            saving.agree_on_writing(snapshot, lambda: saving.write_snapshot(snapshot))
            saving.commit_snapshot(snapshot)
            return
        self._pending = _Writer(snapshot)
        self._pending.start()

    def maybe_finalize(self) -> None:
        """Commit the save in flight if every rank has written its files; never waits for them."""
        if self._pending is not None and self._all_ranks_done():
            self.finalize()

    def finalize(self) -> None:
        """Wait for the save in flight, if any, and commit it: every rank's files written and verified, the
        tracker moves; an error on any rank is an error on every rank (the previous checkpoint stays latest)."""
        writer, self._pending = self._pending, None
        if writer is None:
            return
        writer.join()
        saving.agree_on_writing(writer.snapshot, writer.result)
        saving.commit_snapshot(writer.snapshot)

    def _all_ranks_done(self) -> bool:
        done = not self._pending.is_alive()
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return done
        flag = torch.tensor([int(done)], device=collectives.reduction_device([dist.group.WORLD]))
        collectives.all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MIN)
        return bool(flag.item())
