"""--async-save: the state is copied off the live tensors, written while training goes on, committed only
when every rank's files are written and verified; a kill -9 at any moment leaves a sound latest checkpoint
from which the run resumes exactly."""
import json
import os
import random
import threading
import time

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.verify import verify_checkpoint
from megatron_lite.training import loop
from tests.checkpointing.common import losses_of, tiny_config, train
from tests.distributed import run_distributed, start_ranks


def _saved(root: str, iteration: int) -> dict:
    with open(os.path.join(storage.checkpoint_dir(root, iteration), storage.METADATA_FILE)) as f:
        metadata = json.load(f)
    return {"files": {name: entry["sha256"] for name, entry in metadata["files"].items()},
            "training_state": metadata["training_state"], "scheduler": metadata["scheduler"],
            "rng": metadata["rng"]}


def test_async_save_writes_behind_training_what_a_blocking_save_writes(tmp_path, monkeypatch):
    """Iteration 3 trains while iteration 2's copy is being written: the checkpoint is still iteration 2's."""
    blocking, background = str(tmp_path / "blocking"), str(tmp_path / "async")
    loop.pretrain(tiny_config(iters=4, dropout=0.1, save=blocking, save_interval=2))

    steps_done, writers = [], []
    write_tensor_file, train_step = storage.write_tensor_file, loop.train_step

    def write_after_the_next_step(path, tensors):
        writers.append(threading.current_thread() is threading.main_thread())
        if ".iter_0000002.tmp" in path:  # the live weights move on before this copy is written
            deadline = time.monotonic() + 120
            while len(steps_done) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(steps_done) == 3
        return write_tensor_file(path, tensors)

    def counted_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        steps_done.append(True)
        return result

    monkeypatch.setattr(storage, "write_tensor_file", write_after_the_next_step)
    monkeypatch.setattr(loop, "train_step", counted_step)
    state, _, _ = loop.pretrain(tiny_config(iters=4, dropout=0.1, save=background, save_interval=2, async_save=True))

    assert writers == [False, False]  # both written by the worker thread
    assert storage.read_latest_iteration(background) == 4 and state.iteration == 4
    for iteration in (2, 4):
        assert _saved(background, iteration) == _saved(blocking, iteration)
        verify_checkpoint(storage.checkpoint_dir(background, iteration))


def _train_with_slow_writes(rank, world_size, kwargs, delay_s):
    """``train`` with every checkpoint file write slowed, so that saves are in flight across iterations."""
    write_bytes = storage._write_bytes

    def slow(path, data):
        time.sleep(delay_s)
        return write_bytes(path, data)

    storage._write_bytes = slow
    return train(rank, world_size, kwargs)


def _kill_at_a_random_moment(root: str, kwargs: dict, rng: random.Random) -> int | None:
    """Start 2 ranks training with --async-save, SIGKILL both at a random moment after the first commit
    (or of a resumed run, after its start); return the iteration the tracker names afterwards."""
    first = storage.read_latest_iteration(root)
    procs, _results = start_ranks(_train_with_slow_writes, 2, args=(kwargs, 0.02))
    try:
        deadline = time.monotonic() + 120
        while storage.read_latest_iteration(root) == first and time.monotonic() < deadline:
            assert all(p.exitcode is None for p in procs), [p.exitcode for p in procs]
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        for p in procs:
            p.kill()  # SIGKILL: no cleanup, the writer thread dies wherever it is
        for p in procs:
            p.join(30)
    return storage.read_latest_iteration(root)


def test_kill_9_at_random_moments_keeps_a_verified_latest_and_resumes_exactly(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    root = str(tmp_path / "ckpt")
    common = dict(iters=8, global_batch=2, dropout=0.1)  # dropout: the RNG states must resume exactly too
    uninterrupted = losses_of(run_distributed(train, 2, args=(common,)))
    saving = dict(common, save=root, save_interval=1, async_save=True)
    kills = [_kill_at_a_random_moment(root, saving, rng),
             _kill_at_a_random_moment(root, dict(saving, load=root), rng)]
    for latest in kills:
        assert latest is not None, f"seed {seed}"
    latest = storage.read_latest_iteration(root)
    verify_checkpoint(storage.checkpoint_dir(root, latest))  # every rank's file complete, checksums match
    resumed = losses_of(run_distributed(train, 2, args=(dict(saving, load=root),)))
    assert resumed == uninterrupted, f"seed {seed}: killed with latest at iterations {kills}"
    assert storage.read_latest_iteration(root) == 8


def _failing_worker(rank, world_size, root):
    """Rank 1's background write fails (a disk error); every rank must raise at the commit."""
    from megatron_lite.process_groups.failures import FailedOnAnotherRank

    write_bytes = storage._write_bytes

    def failing(path, data):
        if rank == 1 and path.endswith(".safetensors") and "iter_0000002" in path:
            raise OSError(28, "No space left on device", path)
        return write_bytes(path, data)

    storage._write_bytes = failing
    try:
        train(rank, world_size, dict(iters=3, global_batch=2, save=root, save_interval=1, async_save=True))
    except (storage.CheckpointError, FailedOnAnotherRank) as error:
        return type(error).__name__, str(error)
    return None


def test_a_failed_background_write_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    errors = run_distributed(_failing_worker, 2, args=(root,))
    assert errors[1][0] == "CheckpointError" and "No space left on device" in errors[1][1]
    assert errors[0][0] == "FailedOnAnotherRank" and errors[0][1].startswith("rank 1 failed to write")
    assert storage.read_latest_iteration(root) == 1
    assert not os.path.exists(storage.staging_dir(root, 2))


def test_async_save_needs_save():
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match="--async-save needs --save"):
        tiny_config(async_save=True)


def test_an_exit_commits_the_save_in_flight(tmp_path):
    """--exit-interval stops right after its save: the run must wait for the background write and commit it."""
    root = str(tmp_path / "ckpt")
    uninterrupted, _, _ = loop.pretrain(tiny_config(iters=4, dropout=0.1))
    loop.pretrain(tiny_config(iters=4, dropout=0.1, save=root, exit_interval=2, async_save=True))
    assert storage.read_latest_iteration(root) == 2
    resumed, _, _ = loop.pretrain(tiny_config(iters=4, dropout=0.1, load=root))
    assert resumed.losses == uninterrupted.losses
