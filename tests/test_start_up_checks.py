"""Start-up checks found by a reliability pass (issue 22, items 10 and 12)."""
import json
import random

import numpy as np
from safetensors.torch import load_file

from megatron_lite.checkpointing import storage
from megatron_lite.pretrain_gpt import main as pretrain_main

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "2", "--train-iters", "1", "--eval-interval", "100", "--eval-iters", "1",
         "--no-log-memory"]


def test_a_directory_as_data_path_is_named_a_directory(tmp_path, capsys):
    assert pretrain_main([*MODEL, "--sft", "--train-data-path", str(tmp_path), "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "51"]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: --train-data-path {tmp_path}: a directory, where a file is expected")
    assert "does not exist" not in error
    assert pretrain_main([*MODEL, "--data-path", str(tmp_path), "--vocab-size", "64"]) == 2
    assert f"--data-path {tmp_path}: a directory" in capsys.readouterr().err


def test_two_identical_fresh_runs_save_the_same_random_states(tmp_path):
    """Python's and NumPy's global generators were never seeded: their saved states differed run to run."""
    saved = []
    for run in ("a", "b"):
        random.random(), np.random.rand()  # a fresh process starts its unseeded generators anywhere
        root = tmp_path / run
        assert pretrain_main([*MODEL, "--mock-data", "--vocab-size", "64", "--save", str(root)]) == 0
        saved.append(json.loads((root / "iter_0000001" / storage.METADATA_FILE).read_text())["rng"])
    assert saved[0] == saved[1]
    a, b = (load_file(str(tmp_path / run / "iter_0000001" / "rank_00000.safetensors")) for run in ("a", "b"))
    for name in ("python", "numpy"):
        key = next(k for k in a if k.endswith(name))
        assert a[key].equal(b[key]), key
