"""A save that fails (disk full) leaves no half-written staging directory behind (issue 22, item 9).

Found by a reliability pass: after a disk-full save the .iter_N.tmp stayed, and the restart said
"0.0 GiB free, but one checkpoint needs about 0.0 GiB" without naming the leftover.
"""
import errno
import os

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.preflight import check_save_dir
from megatron_lite.pretrain_gpt import main as pretrain_main

FLAGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--vocab-size", "64", "--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval",
         "100", "--eval-iters", "1", "--no-log-memory", "--save-interval", "1"]


def test_a_disk_full_save_removes_its_staging_directory(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "ckpt")
    write_bytes = storage._write_bytes

    def disk_full_at_iteration_2(path, data):
        if ".iter_0000002.tmp" in path and path.endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write_bytes(path, data)

    monkeypatch.setattr(storage, "_write_bytes", disk_full_at_iteration_2)
    assert pretrain_main([*FLAGS, "--save", root]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert storage.read_latest_iteration(root) == 1
    assert not os.path.exists(storage.staging_dir(root, 2))


def test_too_little_space_names_unfinished_saves(tmp_path):
    os.makedirs(storage.staging_dir(str(tmp_path), 7))  # what a killed save leaves
    with pytest.raises(storage.CheckpointError, match=r"Unfinished saves \(a killed run's\) hold space there: "
                                                      r".*\.iter_0000007\.tmp; remove them"):
        check_save_dir(str(tmp_path), needed_bytes=2**60)
