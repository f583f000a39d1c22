"""One run per --save directory (issue 22, item 2).

Found by a reliability pass: two runs with the same --save destroyed each other's checkpoints (an
empty committed iter_0000001/, mixed iterations). A second run now fails at once naming the holder,
and a lock left by a process that died does not block its restart.
"""
import json
import os
import socket

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.save_lock import LOCK_FILE, SaveLock
from megatron_lite.pretrain_gpt import main as pretrain_main

FLAGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--vocab-size", "64", "--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval",
         "100", "--eval-iters", "1", "--no-log-memory", "--log-interval", "1"]


def test_a_second_run_on_a_locked_save_directory_fails_naming_the_holder(tmp_path, capsys):
    root = tmp_path / "ckpt"
    root.mkdir()
    other_run = SaveLock(str(root))  # what a run training into root holds
    other_run.acquire()
    try:
        assert pretrain_main([*FLAGS, "--save", str(root)]) == 2
    finally:
        other_run.release()
    err = capsys.readouterr().err
    assert f"error: --save {root} is in use by process {os.getpid()} on {socket.gethostname()}" in err
    assert "give this run its own --save" in err
    assert storage.read_latest_iteration(str(root)) is None  # it saved nothing
    # Released: the same command now trains and saves, and leaves no lock behind.
    assert pretrain_main([*FLAGS, "--save", str(root)]) == 0
    assert storage.read_latest_iteration(str(root)) == 2 and not (root / LOCK_FILE).exists()


def test_the_lock_of_a_killed_run_is_taken_over_with_a_note(tmp_path, capsys):
    root = tmp_path / "ckpt"
    root.mkdir()
    # What a run killed with SIGKILL leaves: the file, with no process holding its flock.
    (root / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": 4242, "started": "then", "command": "x"}))
    assert pretrain_main([*FLAGS, "--save", str(root)]) == 0
    assert (f"note: {root / LOCK_FILE} was left by process 4242 on node7 (started then: x), which ended without "
            "releasing it") in capsys.readouterr().err
    assert storage.read_latest_iteration(str(root)) == 2
