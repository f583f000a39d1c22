"""Checkpoints are atomic, verified and never unpickled."""
import hashlib
import json
import os
import pickle
import shutil
import signal
import time

import pytest
import torch
import torch.multiprocessing as multiprocessing

from megatron_lite.checkpointing import CheckpointError, storage
from megatron_lite.config import ConfigError
from megatron_lite.process_groups.failures import FailedOnAnotherRank
from megatron_lite.training.loop import pretrain
import tests.distributed  # noqa: F401 - configures the forkserver to preload torch
from tests.checkpointing.common import tiny_config, train
from tests.distributed import run_distributed


@pytest.fixture
def saved(tmp_path):
    """A single-process run saved at iterations 1 and 2."""
    root = str(tmp_path / "ckpt")
    pretrain(tiny_config(iters=2, save=root, save_interval=1))
    return root


def _load(root, **kwargs):
    state, _, _ = pretrain(tiny_config(load=root, iters=kwargs.pop("iters", 2), **kwargs))
    return state


def _rewrite(root, file_name, data: bytes):
    """Replace a file and fix its size and checksum in the metadata, as a forger would."""
    directory = storage.checkpoint_dir(root, 2)
    with open(os.path.join(directory, file_name), "wb") as f:
        f.write(data)
    path = os.path.join(directory, storage.METADATA_FILE)
    with open(path) as f:
        metadata = json.load(f)
    metadata["files"][file_name].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    with open(path, "w") as f:
        json.dump(metadata, f)


def _flip_a_byte(path):
    """Corrupt a file without changing its size (only the checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_layout_on_disk(saved):
    assert sorted(os.listdir(saved)) == ["iter_0000001", "iter_0000002", storage.TRACKER_FILE]
    assert storage.read_latest_iteration(saved) == 2
    directory = storage.checkpoint_dir(saved, 2)
    assert sorted(os.listdir(directory)) == [storage.METADATA_FILE, "rank_00000.safetensors"]
    with open(os.path.join(directory, storage.METADATA_FILE)) as f:
        metadata = json.load(f)
    entry = metadata["files"]["rank_00000.safetensors"]
    assert entry["sha256"] == storage.sha256_file(os.path.join(directory, "rank_00000.safetensors"))
    assert metadata["training_state"]["iteration"] == 2 and metadata["training_state"]["consumed_train_samples"] == 16
    assert metadata["scheduler"]["num_steps"] == 16  # samples: 2 iterations of 8
    # fp32 training: the main parameters are the weights, stored once.
    assert not any(key.startswith("optimizer.main_param.") for key in metadata["tensors"])
    assert "optimizer.exp_avg_sq.output_layer.weight" in metadata["tensors"]


def test_empty_load_dir_starts_from_scratch(tmp_path):
    assert _load(str(tmp_path), iters=1).iteration == 1


def test_truncated_file_is_reported(saved):
    path = os.path.join(storage.checkpoint_dir(saved, 2), "rank_00000.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="incomplete or corrupt: rank_00000.safetensors has"):
        _load(saved)


def test_flipped_byte_is_reported(saved):
    path = os.path.join(storage.checkpoint_dir(saved, 2), "rank_00000.safetensors")
    _flip_a_byte(path)
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        _load(saved)


def test_missing_file_is_reported(saved):
    os.remove(os.path.join(storage.checkpoint_dir(saved, 2), "rank_00000.safetensors"))
    with pytest.raises(CheckpointError, match="incomplete: rank_00000.safetensors is missing"):
        _load(saved)


def test_truncated_metadata_is_reported(saved):
    path = os.path.join(storage.checkpoint_dir(saved, 2), storage.METADATA_FILE)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="metadata.json: is not valid JSON"):
        _load(saved)


def test_saving_an_iteration_again_replaces_it(saved):
    before = storage.sha256_file(os.path.join(storage.checkpoint_dir(saved, 2), storage.METADATA_FILE))
    pretrain(tiny_config(iters=2, save=saved, save_interval=1, dropout=0.1))  # a different run, same iterations
    assert sorted(os.listdir(saved)) == ["iter_0000001", "iter_0000002", storage.TRACKER_FILE]
    assert storage.sha256_file(os.path.join(storage.checkpoint_dir(saved, 2), storage.METADATA_FILE)) != before
    assert _load(saved).iteration == 2


def test_pointer_to_a_missing_iteration_is_reported(saved):
    storage.write_latest_iteration(saved, 7)
    with pytest.raises(CheckpointError, match="iter_0000007 has no metadata.json"):
        _load(saved)


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: any callable could run instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_pickled_file_is_refused_without_running_it(saved, tmp_path, writer):
    marker = str(tmp_path / "code-ran")
    payload = {"embedding.word_embeddings.weight": torch.zeros(2), "hook": _RunsCode(marker)}
    if writer == "torch.save":
        torch.save(payload, str(tmp_path / "evil.pt"))
        data = (tmp_path / "evil.pt").read_bytes()
    else:
        data = pickle.dumps(payload, protocol=4)
    _rewrite(saved, "rank_00000.safetensors", data)
    with pytest.raises(CheckpointError, match="refuses to open it"):
        _load(saved)
    assert not os.path.exists(marker)


def test_safetensors_whose_header_length_reads_as_a_pickle_opens(tmp_path):
    """A 640-byte header's length is b"\x80\x02..." in little-endian: pickle protocol 2's first bytes."""
    import safetensors.torch

    path = str(tmp_path / "file.safetensors")
    safetensors.torch.save_file({"w": torch.ones(3)}, path, metadata={"pad": "x" * 552})  # a 640-byte header
    assert open(path, "rb").read(2) == b"\x80\x02"
    assert torch.equal(storage.open_safetensors(path).get_tensor("w"), torch.ones(3))


def test_architecture_mismatch_names_the_flag(saved):
    config = tiny_config(load=saved)
    config.model.ffn_hidden_size = 128
    with pytest.raises(ConfigError, match="--ffn-hidden-size"):
        pretrain(config)


def _crashing_save(root: str, point: str, about_to_die) -> None:
    """Train 2 iterations saving each; stop inside the second save at ``point`` until killed."""
    write_bytes, write_latest_iteration = storage._write_bytes, storage.write_latest_iteration

    def wait_for_the_kill():
        about_to_die.set()
        time.sleep(600)

    def crashing_write_bytes(path, data):
        if point == "mid-write" and ".iter_0000002.tmp" in path and path.endswith(".safetensors"):
            with open(path, "wb") as f:  # half the file reaches the disk
                f.write(data[:len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            wait_for_the_kill()
        return write_bytes(path, data)

    def crashing_write_latest_iteration(root, iteration):
        if point == "before-pointer" and iteration == 2:  # directory renamed, pointer not yet replaced
            wait_for_the_kill()
        return write_latest_iteration(root, iteration)

    storage._write_bytes = crashing_write_bytes
    storage.write_latest_iteration = crashing_write_latest_iteration
    pretrain(tiny_config(iters=2, save=root, save_interval=1))


@pytest.mark.parametrize("point", ["mid-write", "before-pointer"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, point):
    root = str(tmp_path / "ckpt")
    # A process forked from the test harness's forkserver (torch already imported there).
    context = multiprocessing.get_context("forkserver")
    about_to_die = context.Event()
    process = context.Process(target=_crashing_save, args=(root, point, about_to_die), daemon=True)
    process.start()
    try:
        assert about_to_die.wait(120), f"the save never reached {point} (exit code {process.exitcode})"
    finally:
        process.kill()  # SIGKILL: no cleanup, no atexit, exactly like the OOM killer
        process.join(30)
    assert process.exitcode == -signal.SIGKILL

    assert storage.read_latest_iteration(root) == 1
    assert os.path.isdir(storage.staging_dir(root, 2)) == (point == "mid-write")
    assert _load(root, iters=1).iteration == 1
    # Training on saves iteration 2 over the debris.
    state = _load(root, iters=2, save=root, save_interval=1)
    assert state.iteration == 2 and storage.read_latest_iteration(root) == 2
    assert not os.path.exists(storage.staging_dir(root, 2))


def _load_and_report(rank, world_size, root):
    try:
        _load(root, global_batch=2)  # the saving run's batch: the LR schedule counts its samples
    except (CheckpointError, FailedOnAnotherRank) as error:
        return type(error).__name__, str(error)
    return None


def test_a_bad_file_on_one_rank_fails_every_rank(tmp_path):
    """Data-parallel rank 1 alone reads its own file (its RNG states): when only that file is
    corrupt, rank 0 loads fine by itself but must raise too, not go on to train alone."""
    root = str(tmp_path / "ckpt")
    run_distributed(train, 2, args=(dict(iters=2, global_batch=2, save=root, save_interval=2),))
    path = os.path.join(storage.checkpoint_dir(root, 2), "rank_00001.safetensors")
    _flip_a_byte(path)
    own_error, other_error = run_distributed(_load_and_report, 2, args=(root,))[::-1]
    assert own_error[0] == "CheckpointError" and "rank_00001.safetensors does not match its SHA-256" in own_error[1]
    assert other_error[0] == "FailedOnAnotherRank"
    assert other_error[1].startswith("rank 1 failed to load the checkpoint at ")


def _another_run(saved, tmp_path):
    """A second run's checkpoint: the same files under another root."""
    other = str(tmp_path / "other")
    shutil.copytree(saved, other)
    return other


@pytest.mark.parametrize("what", ["iteration directory", "tracker", "metadata", "rank file"])
def test_symlink_out_of_the_checkpoint_is_refused(saved, tmp_path, what):
    """Issue 22, item 9: a link inside --load to another run's checkpoint was followed, loading it silently."""
    other = _another_run(saved, tmp_path)
    link = {"iteration directory": storage.checkpoint_dir(saved, 2),
            "tracker": os.path.join(saved, storage.TRACKER_FILE),
            "metadata": os.path.join(storage.checkpoint_dir(saved, 2), storage.METADATA_FILE),
            "rank file": os.path.join(storage.checkpoint_dir(saved, 2), "rank_00000.safetensors")}[what]
    target = os.path.join(other, os.path.relpath(link, saved))
    shutil.rmtree(link) if os.path.isdir(link) else os.remove(link)
    os.symlink(target, link)
    with pytest.raises(CheckpointError, match=f"^{link} is a symbolic link to {os.path.realpath(target)}, outside the "
                                              f"checkpoint directory"):
        _load(saved, iters=3)


def test_symlink_inside_the_checkpoint_is_followed(saved):
    """Links that stay inside (an iteration directory kept elsewhere under --load) are a layout choice."""
    store = os.path.join(saved, "store")
    os.makedirs(store)
    os.rename(storage.checkpoint_dir(saved, 2), os.path.join(store, "iter_0000002"))
    os.symlink(os.path.join("store", "iter_0000002"), storage.checkpoint_dir(saved, 2))
    assert _load(saved, iters=3).iteration == 3


def test_verify_checkpoint_checks_every_file_without_training(saved, capsys):
    from tools.verify_checkpoint import main as verify

    assert verify(["--load", saved, "--all-iterations"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["ok", "ok"]
    # The tensors' file of iteration 2: a load checks only what a rank reads, the tool every file.
    _flip_a_byte(os.path.join(storage.checkpoint_dir(saved, 2), storage.rank_file_name(0)))
    assert verify(["--load", saved, "--all-iterations"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("ok: ") and storage.checkpoint_dir(saved, 1) in out  # the one to fall back to
    assert err.count("error:") == 1 and "rank_00000.safetensors does not match its SHA-256" in err
    assert verify(["--load", saved]) == 2  # the newest, which the tracker names
