"""A malformed metadata.json or tracker file is one error naming the file and the key (issue 22, item 8).

Each case edits a saved checkpoint as a corruption or a careless hand would, then loads it with the
real loader; before the schema each gave a traceback (RecursionError, KeyError, ValueError, a reshape
error) or, for the training state, loaded and trained nothing."""
import json
import os
import subprocess

import pytest

from megatron_lite.checkpointing import CheckpointError, storage
from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.pretrain_gpt import main as pretrain_gpt_main
from megatron_lite.training.loop import pretrain
from tests.checkpointing.common import tiny_config

LAYERNORM = "decoder.layers.0.input_layernorm.weight"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"  # column-parallel: partition_dim 0, stride 2 (SwiGLU)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process run saved at iteration 2 (copied for each case)."""
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    pretrain(tiny_config(iters=2, save=root, save_interval=2))
    return root


@pytest.fixture
def checkpoint(saved, tmp_path):
    root = str(tmp_path / "ckpt")
    subprocess.run(["cp", "-r", saved, root], check=True)
    return root


def _metadata_path(root):
    return os.path.join(storage.checkpoint_dir(root, 2), storage.METADATA_FILE)


def _edit(root, change):
    path = _metadata_path(root)
    with open(path) as f:
        metadata = json.load(f)
    change(metadata)
    with open(path, "w") as f:
        json.dump(metadata, f)


def _set(*keys_and_value):
    *keys, last, value = keys_and_value

    def change(metadata):
        for key in keys:
            metadata = metadata[key]
        metadata[last] = value
    return change


def _delete(*keys):
    *keys, last = keys

    def change(metadata):
        for key in keys:
            metadata = metadata[key]
        del metadata[last]
    return change


def _both(*changes):
    def change(metadata):
        for c in changes:
            c(metadata)
    return change


EDITS = {
    "missing key": (_delete("tensors"), r"tensors is missing"),
    "missing training iteration": (_delete("training_state", "iteration"), r"training_state.iteration is missing"),
    "iteration 10**18": (_both(_set("iteration", 10 ** 18), _set("training_state", "iteration", 10 ** 18)),
                         r"iteration must be an integer from 0 to 1099511627775, not 1000000000000000000"),
    "negative samples": (_set("training_state", "consumed_train_samples", -8),
                         r"training_state.consumed_train_samples must be an integer from 0"),
    "iteration as text": (_set("training_state", "iteration", "2"), r"training_state.iteration must be an integer"),
    "iterations disagree": (_set("training_state", "iteration", 5),
                            r"training_state.iteration is 5, but the checkpoint is of iteration 2"),
    "unknown training-state key": (_set("training_state", "epoch", 3), r"training_state.epoch is not a key"),
    "shape of text": (_set("tensors", LAYERNORM, "global_shape", ["32"]),
                      rf"tensors\['{LAYERNORM}'\].global_shape\[0\] must be an integer"),
    "negative shape": (_set("tensors", LAYERNORM, "global_shape", [-32]),
                       rf"tensors\['{LAYERNORM}'\].global_shape\[0\] must be an integer from 0"),
    "shape that does not split": (_set("tensors", FC1, "global_shape", [129, 32]),
                                  rf"tensors\['{FC1}'\].global_shape\[0\] is 129, which does not split into 2"),
    "split past the shape": (_set("tensors", LAYERNORM, "partition_dim", 3),
                             rf"tensors\['{LAYERNORM}'\].partition_dim is 3, but global_shape \[32\] has 1"),
    "shard in an unlisted file": (_set("tensors", LAYERNORM, "shards", 0, "file", "rank_00009.safetensors"),
                                  rf"tensors\['{LAYERNORM}'\].shards\[0\].file is 'rank_00009.safetensors', which "
                                  r"files does not list"),
    "rng for another rank": (_set("rng", "1", {"python": [3, None], "numpy": ["MT19937", 624, 0, 0.0]}),
                             r"rng must hold one entry per rank, 0 to 0"),
    "config of the wrong type": (_set("config", "model", "num_layers", "4"),
                                 r"config.model.num_layers must be an integer"),
    "unknown config field": (_set("config", "model", "flux_capacitor", 1), r"config.model.flux_capacitor is not"),
    "layout missing": (_delete("layout"), r"layout is missing"),
    "size of text": (_set("files", "rank_00000.safetensors", "size", "528196"),
                     r"files\['rank_00000.safetensors'\].size must be an integer"),
}


@pytest.mark.parametrize("case", EDITS)
def test_malformed_metadata_is_one_error_naming_file_and_key(checkpoint, case):
    change, message = EDITS[case]
    _edit(checkpoint, change)
    with pytest.raises(CheckpointError, match=rf"^{_metadata_path(checkpoint)}: {message}"):
        pretrain(tiny_config(load=checkpoint, iters=3))


@pytest.mark.parametrize("text, message", [
    ('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}", r"nests 100001 levels deep, a checkpoint's at most 32"),
    ("[]", r"the top level must be an object, not a list"),
    ('{"iteration": ' + "9" * 5000 + "}", r"is not valid JSON \(Exceeds the limit"),
    ('{"format": "megatron_lite-checkpoint/0"}', r"format is \"megatron_lite-checkpoint/0\"; this megatron_lite reads"),
], ids=["deeply nested", "a list", "5000 digits", "another format"])
def test_malformed_metadata_text(checkpoint, text, message):
    with open(_metadata_path(checkpoint), "w") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=rf"^{_metadata_path(checkpoint)}: {message}"):
        pretrain(tiny_config(load=checkpoint, iters=3))


def test_edited_shape_that_fits_the_schema_is_caught_against_the_file(checkpoint):
    _edit(checkpoint, _set("tensors", LAYERNORM, "global_shape", [33]))
    with pytest.raises(CheckpointError, match=rf"rank_00000.safetensors holds '{LAYERNORM}' with 32 elements"):
        pretrain(tiny_config(load=checkpoint, iters=3))


def test_tensor_missing_from_its_file(checkpoint):
    _edit(checkpoint, lambda m: m["tensors"].update({"decoder.layers.0.extra": m["tensors"][LAYERNORM]}))
    reader = CheckpointReader(storage.checkpoint_dir(checkpoint, 2))
    with pytest.raises(CheckpointError, match=r"places 'decoder.layers.0.extra' in rank_00000.safetensors, which"):
        reader.read("decoder.layers.0.extra")
    assert pretrain(tiny_config(load=checkpoint, iters=3))[0].iteration == 3  # the model never asks for it


@pytest.mark.parametrize("text", ["²", "1" * 5000, "-1", "2 3", "\xff"], ids=["superscript", "5000 digits",
                                                                            "negative", "two numbers", "not UTF-8"])
def test_malformed_tracker(checkpoint, text):
    with open(os.path.join(checkpoint, storage.TRACKER_FILE), "w", encoding="latin-1") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=rf"{storage.TRACKER_FILE} should hold an iteration number from 0 to "):
        pretrain(tiny_config(load=checkpoint, iters=3))


def test_command_line_reports_one_error_line(checkpoint, capsys):
    _edit(checkpoint, _set("training_state", "iteration", 10 ** 18))
    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--ffn-hidden-size", "64",
             "--seq-length", "16", "--vocab-size", "60", "--make-vocab-size-divisible-by", "32",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "4",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-2",
             "--mock-data", "--load", checkpoint]
    assert pretrain_gpt_main(flags) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert f"{_metadata_path(checkpoint)}: training_state.iteration must be an integer" in errors[0]
