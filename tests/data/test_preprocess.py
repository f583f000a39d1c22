import json
import os

from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.preprocess import preprocess_jsonl
from megatron_lite.tokenizer import build_tokenizer
from tests.data.conftest import TRICKY_TEXT


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def gpt2_kwargs(bpe_files):
    return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])


def test_bad_lines_are_reported_with_file_and_line_and_skipped(tmp_path, bpe_files, capsys):
    texts = ["first document", TRICKY_TEXT, "third", "fourth"]
    path = write_jsonl(tmp_path / "in.jsonl", [
        json.dumps({"text": texts[0]}),
        '{"text": "unterminated',                    # line 2: malformed
        json.dumps({"title": "no text"}),            # line 3: missing key
        "",                                          # line 4: blank, silently ignored
        json.dumps({"text": texts[1], "id": 7}),
        json.dumps({"text": 42}),                    # line 6: not a string
        json.dumps(["a", "list"]),                   # line 7: not an object
        json.dumps({"text": texts[2]}),
        json.dumps({"text": ""}),                    # line 9: empty document
        json.dumps({"text": texts[3]}),
    ])
    stats = preprocess_jsonl([path], output_prefix=str(tmp_path / "out"), tokenizer_kwargs=gpt2_kwargs(bpe_files),
                             append_eod=True, workers=2)
    log = capsys.readouterr().err
    for line_number, problem in [(2, "malformed JSON"), (3, "missing key 'text'"), (6, "key 'text' is int"),
                                 (7, "expected a JSON object")]:
        assert f"{path}:{line_number}: {problem}" in log
    assert "skipped 4 bad lines" in log
    assert (stats.documents, stats.bad_lines) == (5, 4)

    tokenizer = build_tokenizer(**gpt2_kwargs(bpe_files))
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts[:3] + [""] + texts[3:]]
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset.dtype.name == "uint16"


def test_strict_aborts_without_touching_existing_output(tmp_path, bpe_files, load_tool, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [json.dumps({"text": "old corpus"})])
    flags = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", bpe_files[0], "--merge-file", bpe_files[1]]
    tool = load_tool("preprocess_data")
    assert tool.main(["--input", good, *flags]) == 0
    before = {name: (tmp_path / name).read_bytes() for name in ["out_text_document.bin", "out_text_document.idx"]}

    bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"text": "new"})] * 100 + ["{oops"])
    assert tool.main(["--input", bad, "--strict", *flags]) == 1
    assert f"{bad}:101: malformed JSON" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl", *sorted(before)]  # no temporaries left
    assert all((tmp_path / name).read_bytes() == data for name, data in before.items())

    assert tool.main(["--input", bad, *flags]) == 0  # without --strict the bad line is skipped
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 100


def test_worker_count_does_not_change_the_output(tmp_path, demo_texts, sentencepiece_model):
    path = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t, "title": t[:20]}) for t in demo_texts[:150]])
    kwargs = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    outputs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        preprocess_jsonl([path], output_prefix=prefix, tokenizer_kwargs=kwargs, json_keys=("text", "title"),
                         workers=workers, log_interval=50)
        outputs.append([open(f"{prefix}_{key}_document.{ext}", "rb").read()
                        for key in ("text", "title") for ext in ("bin", "idx")])
    assert outputs[0] == outputs[1]
    tokenizer = build_tokenizer(**kwargs)
    titles = IndexedDataset(str(tmp_path / "w1_title_document"))
    assert len(titles) == 150 and tokenizer.detokenize(titles[5]) == demo_texts[5][:20]


def test_null_tokenizer_and_tokenizer_rejections(tmp_path, capsys):
    path = write_jsonl(tmp_path / "ids.jsonl", [json.dumps({"text": "1 2 3"}), json.dumps({"text": "4 999"}),
                                                json.dumps({"text": ""}), json.dumps({"text": "5"})])
    stats = preprocess_jsonl([path], output_prefix=str(tmp_path / "ids"),
                             tokenizer_kwargs=dict(tokenizer_type="NullTokenizer", vocab_size=10))
    assert f"{path}:2: tokenizer rejected 'text'" in capsys.readouterr().err
    assert (stats.documents, stats.bad_lines, stats.empty_documents) == (2, 1, 1)
    dataset = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [5]]
