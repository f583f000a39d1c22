"""Token ids outside the model's vocabulary are one error where data enters (issue 22, item 5).

Found by a reliability pass: ids 600 or 60000 with a 512 vocabulary trained on zeroed embeddings at tp2 and
exited 0 (a bare IndexError at tp1); a tokenizer larger than a checkpoint's vocabulary crashed every rank.
"""
import json

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
from megatron_lite.pretrain_gpt import main as pretrain_main
from tools.preprocess_data import main as preprocess_data

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "2", "--train-iters", "1", "--eval-interval", "100", "--eval-iters", "1",
         "--no-log-memory"]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("bad_id", [600, 60000])
def test_pretraining_data_with_ids_past_the_vocabulary(tmp_path, capsys, bad_id):
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32) as builder:
        for document in range(20):
            builder.add_document([1, 2, 3, bad_id if document == 7 else 4] * 4)
        builder.finalize(index_file_path(prefix))
    assert pretrain_main([*MODEL, "--data-path", prefix, "--vocab-size", "512"]) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert errors == [f"error: {prefix}.bin: token id {bad_id} (token {7 * 16 + 3} of the file) is outside the "
                      f"model's vocabulary of 512 ids: the data was tokenized with another tokenizer. Preprocess it "
                      f"again with this run's tokenizer (tools/preprocess_data.py), or train with the tokenizer (or "
                      f"--vocab-size) it was made with."]


def test_preprocessed_fine_tuning_data_with_ids_past_the_vocabulary(tmp_path, capsys):
    source = tmp_path / "sft.jsonl"
    source.write_text(json.dumps({"prompt": "1 2", "response": "80"}) + "\n")
    prefix = str(tmp_path / "sft")
    assert preprocess_data(["--sft", "--input", str(source), "--output-prefix", prefix, "--tokenizer-type",
                            "NullTokenizer", "--vocab-size", "100"]) == 0
    assert pretrain_main([*MODEL, "--sft", "--train-data-path", prefix, "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "51"]) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "token id 80 (token 2 of the file)" in errors[0], errors
    assert "vocabulary of 51 ids" in errors[0]


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary(chat_tokenizer_dir, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    assert pretrain_main([*MODEL, "--mock-data", "--vocab-size", "64", "--save", ckpt]) == 0
    capsys.readouterr()
    chat = ["--sft", "--train-data-path", str(tmp_path / "unused.jsonl"), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", chat_tokenizer_dir]
    assert pretrain_main([*MODEL, *chat, "--use-checkpoint-args", "--pretrained-checkpoint", ckpt]) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "tokens, but the model's vocabulary" in errors[0], errors
    assert "has 64: ids 64-" in errors[0] and "would have no embedding" in errors[0]
