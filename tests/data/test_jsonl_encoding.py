"""Bytes that are not UTF-8 in JSONL input are one error naming file:line and the byte offset (issue 22, item 7).

Found by a reliability pass: a per-rank UnicodeDecodeError traceback, and preprocessing that threw away the
documents tokenized so far reporting "position 6251", an offset inside a read buffer, not in the file.
"""
import json

from megatron_lite.pretrain_gpt import main as pretrain_main
from tools.preprocess_data import main as preprocess_data


def _write_with_bad_line(path, good_lines: int) -> int:
    """good_lines valid records, then one with a Latin-1 byte; returns the bad byte's file offset."""
    good = "".join(json.dumps({"prompt": "1 2", "response": "3", "text": "1 2 3"}) + "\n" for _ in range(good_lines))
    bad = b'{"prompt": "caf\xe9", "response": "3", "text": "x"}\n'
    path.write_bytes(good.encode() + bad)
    return len(good.encode()) + bad.index(b"\xe9")


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_fine_tuning_jsonl_with_a_non_utf8_line(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    offset = _write_with_bad_line(data, good_lines=3)
    assert pretrain_main(["--sft", "--train-data-path", str(data), "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "51", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
                          "2", "--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "1",
                          "--no-log-memory"]) == 2
    (error,) = _errors(capsys)
    assert error.startswith(f"error: {data}:4: not UTF-8 text (byte 0xe9 at byte offset {offset} of the file)")


def test_preprocessing_names_the_line_past_a_thousand_documents(tmp_path, capsys):
    data = tmp_path / "corpus.jsonl"
    offset = _write_with_bad_line(data, good_lines=1000)
    assert preprocess_data(["--input", str(data), "--output-prefix", str(tmp_path / "out"), "--json-keys", "text",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]) == 1  # the tool's failure code
    (error,) = _errors(capsys)
    assert error.startswith(f"error: {data}:1001: not UTF-8 text (byte 0xe9 at byte offset {offset} of the file)")
