"""Fine-tuning data: bad lines named, preprocessing equal to reading JSONL, padded and packed samples."""
import json

import numpy as np
import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import parse_args
from megatron_lite.data.sft import SFTDataError, SFTDataset, load_sft_examples
from megatron_lite.data.sft.sft_dataset import build_sample, next_fit_bins
from megatron_lite.model.document_rows import PackedDocuments
from megatron_lite.tokenizer import build_tokenizer
from megatron_lite.pretrain_gpt import main as pretrain_main
from tools.preprocess_data import main as preprocess_data

TOKENIZER = build_tokenizer("NullTokenizer", vocab_size=50)  # data ids 0-49, EOD 50


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _pair(prompt: list[int], response: list[int]) -> dict:
    return {"prompt": " ".join(map(str, prompt)), "response": " ".join(map(str, response))}


BAD_LINES = [  # (line, what the report says)
    ('{"prompt": "1 2", "response": ', "malformed JSON"),
    ({"prompt": "1 2"}, 'needs "prompt" and "response", or "messages"'),
    ({"prompt": "1 2", "response": "  "}, "empty response"),
    ({"messages": [{"role": "user", "content": "1"}]}, "the last message must be the assistant's"),
    ({"messages": [{"role": "robot", "content": "1"}, {"role": "assistant", "content": "2"}]},
     "message 1 needs a role"),
    ({"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": ""}]},
     "empty response (message 2)"),
    (_pair([1], [99]), "outside [0, --vocab-size 50)"),  # the tokenizer rejects the text
]


def test_bad_lines_are_named_with_file_and_line(tmp_path):
    good = [_pair([1, 2], [3]), {"messages": [{"role": "user", "content": "4"}, {"role": "assistant", "content": "5"}]}]
    path = _write(tmp_path / "bad.jsonl", good[:1] + [line for line, _ in BAD_LINES] + good[1:])
    with pytest.raises(SFTDataError) as raised:
        load_sft_examples([path], TOKENIZER, "plain")
    message = str(raised.value)
    assert f"{len(BAD_LINES)} bad line(s)" in message
    for number, (_, problem) in enumerate(BAD_LINES, start=2):
        assert f"{path}:{number}: " in message and problem in message.split(f"{path}:{number}: ")[1].split("\n")[0]


def test_preprocessed_examples_equal_the_jsonl_and_bad_lines_are_reported(tmp_path, capsys):
    records = [_pair([1, 2, 3], [4, 5]), {"messages": [{"role": "system", "content": "7"},
                                                       {"role": "user", "content": "8 9"},
                                                       {"role": "assistant", "content": "10"},
                                                       {"role": "user", "content": "11"},
                                                       {"role": "assistant", "content": "12 13"}]}]
    path = _write(tmp_path / "sft.jsonl", records[:1] + [BAD_LINES[2][0]] + records[1:])
    assert preprocess_data(["--sft", "--input", path, "--output-prefix", str(tmp_path / "out"),
                                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]) == 0
    captured = capsys.readouterr()
    assert f"{path}:2: empty response; skipped" in captured.err
    assert f"--sft --train-data-path {tmp_path / 'out'}" in captured.out
    preprocessed = load_sft_examples([str(tmp_path / "out")], TOKENIZER, "plain")
    direct = load_sft_examples([_write(tmp_path / "good.jsonl", records)], TOKENIZER, "plain")
    assert len(preprocessed) == len(direct) == 2
    for i in range(2):
        for ours, theirs in zip(preprocessed.get(i), direct.get(i)):
            np.testing.assert_array_equal(ours, theirs)
    ids, mask = preprocessed.get(1)
    assert ids.tolist() == [7, 8, 9, 10, 11, 12, 13, 50]
    assert mask.tolist() == [0, 0, 0, 1, 0, 1, 1, 1]  # both assistant turns and the EOD


def _examples(tmp_path, pairs):
    return load_sft_examples([_write(tmp_path / "data.jsonl", [_pair(p, r) for p, r in pairs])], TOKENIZER, "plain")


def test_a_padded_sample_has_loss_exactly_on_labels_that_are_response_tokens_or_eod(tmp_path):
    examples = _examples(tmp_path, [([1, 2, 3], [4, 5])])
    sample = build_sample([examples.get(0)], seq_length=8, pad_token=TOKENIZER.pad, pack_sequences=False)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 50, 50, 50]
    assert sample["labels"].tolist() == [2, 3, 4, 5, 50, 50, 50, 50]
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # labels 4, 5 and the EOD
    assert sample["position_ids"].tolist()[:5] == [0, 1, 2, 3, 4] and "attention_mask" not in sample


def test_packing_restarts_positions_and_blocks_attention_across_examples(tmp_path):
    examples = _examples(tmp_path, [([1, 2], [3]), ([4], [5, 6])])
    sample = build_sample([examples.get(0), examples.get(1)], seq_length=8, pad_token=TOKENIZER.pad,
                          pack_sequences=True)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 50, 50]
    assert sample["labels"].tolist() == [2, 3, 50, 5, 6, 50, 50, 50]
    assert sample["loss_mask"].tolist() == [0, 1, 1, 1, 1, 1, 0, 0]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    documents = [0, 0, 0, 1, 1, 1, 2, 2]
    assert sample["document_ids"].tolist() == documents and "attention_mask" not in sample  # no [s, s] mask
    allowed = ~PackedDocuments(torch.tensor(sample["document_ids"])[None]).mask()[0, 0]
    for query in range(8):
        assert [key for key in range(8) if allowed[query, key]] == [
            key for key in range(query + 1) if documents[key] == documents[query]]


def test_next_fit_packing():
    assert next_fit_bins(np.array([3, 4, 2, 5, 5]), 8).tolist() == [0, 2, 4, 5]  # [3, 4] [2, 5] [5]


@pytest.mark.parametrize("pack", [False, True])
def test_every_epoch_uses_every_example_once(tmp_path, pack):
    pairs = [([i], [i + 1] * (1 + i % 3)) for i in range(1, 11)]
    examples = _examples(tmp_path, pairs)
    dataset = SFTDataset(examples, seq_length=8, num_samples=30, seed=3, pad_token=TOKENIZER.pad, pack_sequences=pack)
    first_tokens = [t for i in range(len(dataset)) for t, p in zip(dataset[i]["tokens"], dataset[i]["position_ids"])
                    if p == 0 and t != TOKENIZER.pad]
    epoch = len(dataset.layout.orders[0])
    assert epoch == 10 and sorted(first_tokens[:epoch]) == list(range(1, 11))
    assert sorted(first_tokens[epoch:2 * epoch]) == list(range(1, 11))
    assert first_tokens[:epoch] != first_tokens[epoch:2 * epoch]  # each epoch in its own order


def test_truncation_is_counted_never_silent(tmp_path):
    examples = _examples(tmp_path, [([1, 2], [3]), ([1] * 5, [2] * 6), ([1] * 12, [2])])
    dataset = SFTDataset(examples, seq_length=8, num_samples=3, seed=0, pad_token=TOKENIZER.pad)
    assert (dataset.num_truncated, dataset.num_without_loss) == (2, 1)
    line = dataset.describe()
    assert "2 examples longer than --seq-length + 1 = 9 tokens truncated" in line
    assert "1 of them losing every response token" in line
    truncated = build_sample([examples.get(1)], seq_length=8, pad_token=TOKENIZER.pad, pack_sequences=False)
    assert truncated["tokens"].tolist() == [1] * 5 + [2] * 3 and truncated["loss_mask"].sum() == 4


SMALL_RUN = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "51", "--num-layers", "1", "--hidden-size", "16",
             "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "2",
             "--eval-interval", "2", "--eval-iters", "1", "--no-log-memory", "--log-interval", "1"]


def test_the_sft_command_logs_validation_test_and_truncation(tmp_path, capsys):
    data = _write(tmp_path / "sft.jsonl", [_pair([1, 2], [3]), _pair([4] * 9, [5]), _pair([6], [7, 8])])
    assert pretrain_main(["--sft", "--train-data-path", data, "--valid-data-path", data, "--test-data-path", data,
                          "--sft-pack-sequences", *SMALL_RUN]) == 0
    out = capsys.readouterr().out
    assert (" data: train 3 fine-tuning examples (4 samples of 8 positions, packed, 2 epochs; 1 examples longer "
            "than --seq-length + 1 = 9 tokens truncated, 1 of them losing every response token") in out
    assert " validation loss at iteration 2 | lm loss value: " in out
    assert " validation loss at iteration 2 on test set | lm loss value: " in out


def test_the_sft_command_names_bad_lines_and_wrong_flags(tmp_path, capsys):
    data = _write(tmp_path / "sft.jsonl", [_pair([1, 2], [3]), {"prompt": "1"}])
    assert pretrain_main(["--sft", "--train-data-path", data, *SMALL_RUN]) == 2
    assert f"{data}:2: needs \"prompt\" and \"response\"" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="add --sft"):
        parse_args(["--train-data-path", data, *SMALL_RUN])
    with pytest.raises(ConfigError, match="--sft needs --train-data-path"):
        parse_args(["--sft", *SMALL_RUN])
    with pytest.raises(ConfigError, match="--sft-tokenizer-prompt-format"):
        parse_args(["--sft", "--train-data-path", data, "--sft-tokenizer-prompt-format", "alpaca", *SMALL_RUN])


def test_preprocessed_data_remembers_its_prompt_format(tmp_path, capsys):
    """Found on a first day: a run on data preprocessed with one --sft-tokenizer-prompt-format but given
    another (or none) saved that one, and generation then rendered prompts with the wrong template."""
    prefix = str(tmp_path / "out")
    assert preprocess_data(["--sft", "--input", _write(tmp_path / "sft.jsonl", [_pair([1, 2], [3])]),
                            "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "50",
                            "--sft-tokenizer-prompt-format", "plain"]) == 0
    assert json.loads((tmp_path / "out_prompt_format.json").read_text()) == {"sft_tokenizer_prompt_format": "plain"}
    assert len(load_sft_examples([prefix], TOKENIZER, "plain")) == 1
    with pytest.raises(ConfigError) as error:
        load_sft_examples([prefix], TOKENIZER, "chatml")
    assert str(error.value) == (f"{prefix} was preprocessed with --sft-tokenizer-prompt-format plain, but this run's "
                                f"is chatml: give --sft-tokenizer-prompt-format plain (or preprocess the data again "
                                f"with chatml).")
    # At training start-up it is the run's one error line.
    capsys.readouterr()
    assert pretrain_main(["--sft", "--train-data-path", prefix, "--sft-tokenizer-prompt-format", "chatml",
                          *SMALL_RUN]) == 2
    assert f"error: {error.value}" in capsys.readouterr().err
    # Data preprocessed before the record existed is read as before, unchecked.
    (tmp_path / "out_prompt_format.json").unlink()
    assert len(load_sft_examples([prefix], TOKENIZER, "chatml")) == 1
