import json
import os
import struct

import numpy as np
import pytest

from megatron_lite.data import preprocess
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
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]  # the empty document has no sequence
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset.document_indices.tolist() == [0, 1, 2, 3, 3, 4]
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


def test_worker_count_does_not_change_the_output(tmp_path, demo_texts, sentencepiece_model, monkeypatch):
    """Nor does the main process tokenizing a share of the tasks, as it does where a core is left over."""
    path = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t, "title": t[:20]}) for t in demo_texts[:150]])
    kwargs = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    monkeypatch.setattr(preprocess, "LINES_PER_TASK", 8)  # 19 tasks, for the main process to take some of
    encode_records, encoded_here = preprocess._encode_records, []
    monkeypatch.setattr(preprocess, "_encode_records",  # counts the main process's tasks (a worker counts its own)
                        lambda *args, **kw: encoded_here.append(1) or encode_records(*args, **kw))
    outputs, tasks_here = [], []
    for workers, cores in [(1, 1), (1, 2), (2, 4)]:
        monkeypatch.setattr(preprocess, "_usable_cores", lambda: cores)
        prefix = str(tmp_path / f"w{workers}c{cores}")
        preprocess_jsonl([path], output_prefix=prefix, tokenizer_kwargs=kwargs, json_keys=("text", "title"),
                         workers=workers, log_interval=50)
        outputs.append([open(f"{prefix}_{key}_document.{ext}", "rb").read()
                        for key in ("text", "title") for ext in ("bin", "idx")])
        tasks_here.append(len(encoded_here))
        encoded_here.clear()
    assert outputs[0] == outputs[1] == outputs[2]
    assert tasks_here[0] == 0 and tasks_here[1] > 0 and tasks_here[2] > 0
    tokenizer = build_tokenizer(**kwargs)
    titles = IndexedDataset(str(tmp_path / "w1c1_title_document"))
    assert len(titles) == 150 and tokenizer.detokenize(titles[5]) == demo_texts[5][:20]


def test_null_tokenizer_and_tokenizer_rejections(tmp_path, capsys):
    path = write_jsonl(tmp_path / "ids.jsonl", [json.dumps({"text": "1 2 3"}), json.dumps({"text": "4 999"}),
                                                json.dumps({"text": ""}), json.dumps({"text": "5"})])
    stats = preprocess_jsonl([path], output_prefix=str(tmp_path / "ids"),
                             tokenizer_kwargs=dict(tokenizer_type="NullTokenizer", vocab_size=10))
    assert f"{path}:2: tokenizer rejected 'text'" in capsys.readouterr().err
    assert (stats.documents, stats.bad_lines, stats.empty_documents) == (3, 1, 1)
    dataset = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [5]]
    assert dataset.document_indices.tolist() == [0, 1, 1, 2]


def megatron_preprocess(texts, tokenizer, append_eod):
    """Megatron-LM's Encoder.encode and IndexedDatasetBuilder.add_document, restated: returns the
    .bin and .idx bytes. Empty sentences add no sequence, EOD goes after a non-empty document only,
    and every document appends len(sequence_lengths) to the document indices."""
    tokens, sequence_lengths, document_indices = [], [], [0]
    for text in texts:
        doc_ids, sentence_lens = [], []
        ids = tokenizer.tokenize(text)
        if ids:
            doc_ids += ids
            sentence_lens.append(len(ids))
        if doc_ids and append_eod:
            doc_ids.append(tokenizer.eod)
            sentence_lens[-1] += 1
        tokens += doc_ids
        sequence_lengths += sentence_lens
        document_indices.append(len(sequence_lengths))
    n, d = len(sequence_lengths), len(document_indices)
    pointers = np.concatenate([[0], np.cumsum(sequence_lengths)[:-1] * 2]).astype(np.int64) if n else []
    index = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, d) + struct.pack(f"<{n}i", *sequence_lengths)
             + struct.pack(f"<{n}q", *pointers) + struct.pack(f"<{d}q", *document_indices))
    return np.asarray(tokens, dtype="<u2").tobytes(), index


@pytest.mark.parametrize("append_eod", [True, False])
def test_empty_documents_give_megatrons_bytes(tmp_path, bpe_files, append_eod):
    """{"text": ""} writes no sequence (no lone EOD) but keeps its document-index entry, as in Megatron-LM."""
    texts = ["", "first document", "", "", TRICKY_TEXT, "last", ""]
    path = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t, "title": t[:5]}) for t in texts])
    stats = preprocess_jsonl([path], output_prefix=str(tmp_path / "out"), tokenizer_kwargs=gpt2_kwargs(bpe_files),
                             json_keys=("text", "title"), append_eod=append_eod, workers=2)
    assert (stats.documents, stats.empty_documents) == (7, 4)
    tokenizer = build_tokenizer(**gpt2_kwargs(bpe_files))
    for key, key_texts in [("text", texts), ("title", [t[:5] for t in texts])]:
        expected_bin, expected_idx = megatron_preprocess(key_texts, tokenizer, append_eod)
        assert (tmp_path / f"out_{key}_document.bin").read_bytes() == expected_bin
        assert (tmp_path / f"out_{key}_document.idx").read_bytes() == expected_idx
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(dataset) == 3 and dataset.document_indices.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]


def test_a_wrong_json_key_is_an_error_naming_the_keys_found(tmp_path, bpe_files, load_tool, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [json.dumps({"content": "some text", "id": 1})] * 3)
    tool = load_tool("preprocess_data")
    code = tool.main(["--input", corpus, "--json-keys", "text", "--output-prefix", str(tmp_path / "out"),
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe_files[0], "--merge-file",
                      bpe_files[1]])
    captured = capsys.readouterr()
    assert code == 1 and "--data-path" not in captured.out  # no prefix to train on is suggested
    assert "error: no documents written: all 3 lines were skipped" in captured.err
    assert "missing key 'text' (--json-keys); the line has keys ['content', 'id']" in captured.err
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]  # nothing half-written


def test_a_wrong_json_key_on_a_large_corpus_stops_early(tmp_path, bpe_files, load_tool, capsys):
    """Found on a first day: 828 lines with a wrong --json-keys printed 828 "skipped" lines before the error."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [json.dumps({"content": "some text"})] * 500)
    tool = load_tool("preprocess_data")
    code = tool.main(["--input", corpus, "--json-keys", "text", "--output-prefix", str(tmp_path / "out"),
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe_files[0], "--merge-file",
                      bpe_files[1]])
    err = capsys.readouterr().err
    assert code == 1 and "error: the first 20 lines were all skipped, the first as " in err
    assert "Fix --json-keys" in err and len(err.splitlines()) <= 21
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_a_mistyped_flag_is_one_line_with_the_nearest_flag(tmp_path, bpe_files, load_tool, capsys):
    tool = load_tool("preprocess_data")
    code = tool.main(["--input", "c.jsonl", "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                      "GPT2BPETokenizer", "--vocab-file", bpe_files[0], "--merge-file", bpe_files[1], "--apend-eod"])
    err = capsys.readouterr().err
    assert code == 2 and err == "error: unrecognized argument --apend-eod (did you mean --append-eod?)\n"


def test_the_command_runs_without_pytorch(tmp_path, bpe_files):
    """tools/preprocess_data.py writes indexed datasets with the tokenizer alone: importing PyTorch would be
    most of its start-up (the whole command, two workers, in a fresh interpreter)."""
    import subprocess
    import sys

    from tests.data.conftest import REPO_ROOT

    corpus = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "some text"})] * 3)
    check = ("import atexit, runpy, sys; atexit.register(lambda: print('torch' in sys.modules)); "
             "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run(
        [sys.executable, "-c", check, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input", corpus,
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
         bpe_files[0], "--merge-file", bpe_files[1], "--workers", "2"], capture_output=True, text=True)
    assert result.stdout.split()[-1] == "False", result.stdout + result.stderr
    length = len(build_tokenizer(**gpt2_kwargs(bpe_files)).tokenize("some text"))
    assert IndexedDataset(str(tmp_path / "out_text_document")).sequence_lengths.tolist() == [length] * 3
