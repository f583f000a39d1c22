"""Fine-tuning data in the Hugging Face world's files and shapes reads as the same examples as our JSONL:
the same conversations, the same first training loss through pretrain_gpt --sft, the same preprocessed data."""
import json
import re
import sys

import numpy as np
import pytest

from megatron_lite.data.sft import RecordFormat, SFTDataError, load_sft_examples
from megatron_lite.data.sft.examples import read_conversations
from megatron_lite.pretrain_gpt import main as pretrain_main
from megatron_lite.tokenizer import build_tokenizer
from tools.preprocess_data import main as preprocess_data

pytest.importorskip("pyarrow")
import pyarrow  # noqa: E402
import pyarrow.feather  # noqa: E402
import pyarrow.parquet  # noqa: E402

TOKENIZER = build_tokenizer("NullTokenizer", vocab_size=50)
SYSTEM, HISTORY = "7", [("8 9", "10")]
# Our JSONL, the reference: a prompt/response pair and a chat with a system prompt and an earlier turn.
OURS = [{"prompt": "1 2\n3", "response": "4 5"},  # Alpaca's instruction "1 2" and input "3", joined by a newline
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "8 9"},
                      {"role": "assistant", "content": "10"}, {"role": "user", "content": "11"},
                      {"role": "assistant", "content": "12 13"}]},
        {"prompt": "14", "response": "15 16 17"}]
# The same three examples in each other shape.
ALPACA = [{"instruction": "1 2", "input": "3", "output": "4 5"},
          {"system": SYSTEM, "history": [list(turn) for turn in HISTORY], "instruction": "11", "output": "12 13"},
          {"instruction": "14", "input": "", "output": "15 16 17"}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "1 2\n3"}, {"from": "gpt", "value": "4 5"}]},
            {"system": SYSTEM, "conversations": [{"from": "human", "value": "8 9"}, {"from": "gpt", "value": "10"},
                                                 {"from": "human", "value": "11"}, {"from": "gpt", "value": "12 13"}]},
            {"conversations": [{"role": "user", "content": "14"}, {"role": "assistant", "content": "15 16 17"}]}]
# A table's columns are its first row's: there every row has every column, empty where a record has none.
ALPACA_TABLE = [{"instruction": "1 2", "input": "3", "output": "4 5", "system": "", "history": []},
                {"instruction": "11", "input": "", "output": "12 13", "system": SYSTEM,
                 "history": [list(turn) for turn in HISTORY]},
                {"instruction": "14", "input": "", "output": "15 16 17", "system": "", "history": []}]
SHAREGPT_TABLE = [dict(system="", **SHAREGPT[0]), SHAREGPT[1],
                  {"system": "", "conversations": [{"from": "human", "value": "14"},
                                                   {"from": "gpt", "value": "15 16 17"}]}]
# Alpaca under other column names, read with --sft-data-keys.
RENAMED = [{"query": r["instruction"], "context": r["input"], "answer": r["output"], "system": r["system"],
            "history": r["history"]} for r in ALPACA_TABLE]
RENAMED_KEYS = ["instruction=query", "input=context", "output=answer"]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _json_array(path, records):
    path.write_text(json.dumps(records, indent=2))  # elements over several lines, as downloads are
    return str(path)


def _parquet(path, records):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), str(path))
    return str(path)


def _arrow(path, records):
    pyarrow.feather.write_feather(pyarrow.Table.from_pylist(records), str(path), compression="uncompressed")
    return str(path)


def _datasets_dir(path, records):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return str(path)


# (name, writer, records, --sft-data-keys, the format the summary names)
SOURCES = [
    ("alpaca_jsonl", _jsonl, ALPACA, [], "JSONL of alpaca records"),
    ("sharegpt_jsonl", _jsonl, SHAREGPT, [], "JSONL of sharegpt records"),
    ("json_array", _json_array, OURS, [], "JSON array of prompt_response and messages records"),
    ("parquet_sharegpt", _parquet, SHAREGPT_TABLE, [], "Parquet of sharegpt records"),
    ("arrow_alpaca", _arrow, ALPACA_TABLE, [], "Arrow of alpaca records"),
    ("datasets_dir", _datasets_dir, RENAMED, RENAMED_KEYS, "datasets directory of alpaca records"),
]


def _write_source(tmp_path, name, writer, records):
    suffix = {"_parquet": ".parquet", "_arrow": ".arrow", "_json_array": ".json", "_jsonl": ".jsonl"}
    return writer(tmp_path / (name + suffix.get(writer.__name__, "")), records)


def _conversations(path, keys=()):
    return [messages for _, messages in read_conversations(path, RecordFormat.from_flags("auto", list(keys)))]


@pytest.mark.parametrize("name, writer, records, keys, described", SOURCES, ids=[s[0] for s in SOURCES])
def test_every_format_reads_as_the_same_conversations_and_examples(tmp_path, name, writer, records, keys, described):
    reference = _jsonl(tmp_path / "ours.jsonl", OURS)
    path = _write_source(tmp_path, name, writer, records)
    assert _conversations(path, keys) == _conversations(reference)
    ours = load_sft_examples([reference], TOKENIZER, "plain")
    theirs = load_sft_examples([path], TOKENIZER, "plain", RecordFormat.from_flags("auto", keys))
    assert len(theirs) == len(ours) == 3
    for i in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(theirs.get(i), ours.get(i)))
    assert theirs.descriptions[0].startswith(f"{path}: {described}")


SMALL_RUN = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "51", "--num-layers", "1", "--hidden-size", "16",
             "--num-attention-heads", "2", "--seq-length", "12", "--micro-batch-size", "3", "--train-iters", "1",
             "--no-log-memory", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _first_loss(capsys, path, *flags) -> float:
    capsys.readouterr()
    assert pretrain_main(["--sft", "--train-data-path", path, *flags, *SMALL_RUN]) == 0
    out = capsys.readouterr().out
    return float(re.search(r" lm loss: ([0-9.E+-]+) \|", out).group(1)), out


def test_every_format_trains_the_first_loss_of_our_jsonl(tmp_path, capsys):
    """Through the real entry point: the data flags are all that differ between the runs."""
    reference, _ = _first_loss(capsys, _jsonl(tmp_path / "ours.jsonl", OURS))
    for name, writer, records, keys, described in SOURCES:
        path = _write_source(tmp_path, name, writer, records)
        loss, out = _first_loss(capsys, path, *(["--sft-data-keys", *keys] if keys else []))
        assert loss == reference, name
        assert f"; {path}: {described}" in out  # the start-up summary says what each file was read as


def test_sft_format_forces_a_shape_and_data_keys_rename_columns(tmp_path):
    path = _jsonl(tmp_path / "both.jsonl", [{"instruction": "1", "output": "2", "prompt": "9", "response": "3"}])
    assert _conversations(path)[0][0] == {"role": "user", "content": "1"}  # auto: Alpaca's keys come first
    forced = read_conversations(path, RecordFormat(name="prompt_response"))
    assert forced[0][1][0] == {"role": "user", "content": "9"}
    with pytest.raises(SFTDataError, match=r"pairs.jsonl:1: Alpaca needs \"instruction\" and \"output\""):
        read_conversations(_jsonl(tmp_path / "pairs.jsonl", OURS[:1]), RecordFormat(name="alpaca"))
    keys = RecordFormat.from_flags("sharegpt", ["conversations=dialog"])
    assert read_conversations(_jsonl(tmp_path / "d.jsonl", [{"dialog": SHAREGPT[0]["conversations"]}]), keys)


def test_bad_records_are_named_by_line_in_a_json_array_and_by_row_in_a_table(tmp_path):
    records = [OURS[0], {"conversations": [{"from": "robot", "value": "1"}]}, {"instruction": "1", "output": " "}]
    path = _json_array(tmp_path / "bad.json", records)
    with pytest.raises(SFTDataError) as raised:
        load_sft_examples([path], TOKENIZER, "plain")
    message = str(raised.value)
    # indent=2: the elements start on lines 2, 6 and 14.
    assert "2 bad line(s)" in message
    assert f"{path}:6: message 1 needs a role among human, gpt, system, user, assistant, got 'robot'" in message
    assert f"{path}:14: empty response" in message
    table = _parquet(tmp_path / "bad.parquet", [ALPACA[0], {"instruction": "1", "input": None, "output": None}])
    with pytest.raises(SFTDataError, match=rf"{re.escape(table)}:2: 'output' is NoneType, not a string"):
        load_sft_examples([table], TOKENIZER, "plain")
    (tmp_path / "latin1.json").write_bytes('[{"prompt": "1",\n "response": "caf\xe9"}]'.encode("latin-1"))
    with pytest.raises(SFTDataError, match=r"latin1.json:2: not UTF-8 text \(invalid continuation byte at byte 34\)"):
        load_sft_examples([str(tmp_path / "latin1.json")], TOKENIZER, "plain")
    (tmp_path / "broken.json").write_text('[{"prompt": "1", "response": "2"},\n {"prompt": "1" "response"}]')
    with pytest.raises(SFTDataError, match=r"broken.json:2: malformed JSON array \(Expecting ','"):
        load_sft_examples([str(tmp_path / "broken.json")], TOKENIZER, "plain")


def test_without_pyarrow_a_table_is_one_error_naming_the_extra(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "data.parquet", OURS[:1])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(SFTDataError, match=r'needs pyarrow: pip install "megatron_lite\[hf\]"'):
        load_sft_examples([path], TOKENIZER, "plain")


def test_preprocessing_a_table_writes_the_examples_of_our_jsonl(tmp_path, capsys):
    path = _parquet(tmp_path / "sharegpt.parquet", SHAREGPT_TABLE)
    prefix = str(tmp_path / "out")
    assert preprocess_data(["--sft", "--input", path, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "50", "--sft-format", "sharegpt"]) == 0
    preprocessed = load_sft_examples([prefix], TOKENIZER, "plain")
    ours = load_sft_examples([_jsonl(tmp_path / "ours.jsonl", OURS)], TOKENIZER, "plain")
    assert [np.array_equal(a, b) for i in range(3) for a, b in zip(preprocessed.get(i), ours.get(i))] == [True] * 6
    capsys.readouterr()
    assert preprocess_data(["--sft", "--input", path, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "50", "--sft-data-keys", "prompt"]) == 2
    assert "--sft-data-keys takes NAME=COLUMN" in capsys.readouterr().err


def test_preprocessing_progress_shows_the_share_done_and_an_eta(tmp_path, capsys):
    path = _jsonl(tmp_path / "ours.jsonl", OURS * 4)
    assert preprocess_data(["--sft", "--input", path, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                            "NullTokenizer", "--vocab-size", "50", "--log-interval", "6"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("processed")]
    assert len(lines) == 2
    assert re.search(r"\(\d+\.\d docs/s, \d+\.\d\d MB/s, 50\.\d% of 0\.00 MB, ETA 0:00:0\d\)$", lines[0]), lines[0]
    assert ", 100.0% of 0.00 MB, ETA 0:00:00)" in lines[1]
