"""A misnamed field in fine-tuning data fails before the model is built, as one line per kind of mistake."""
import json

from megatron_lite import pretrain_gpt

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--vocab-size", "64", "--train-iters", "1", "--sft", "--tokenizer-type",
        "NullTokenizer"]
TURNS = [{"from": "human", "value": "1 2"}, {"from": "gpt", "value": "3"}]


def test_a_misnamed_field_is_one_line_with_its_count_before_the_model_is_built(tmp_path, capsys):
    data = tmp_path / "sharegpt.jsonl"
    records = [{"conversation": TURNS}] * 20 + [{"conversations": TURNS[:1]}] * 2 + [{"conversations": TURNS}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert pretrain_gpt.main([*TINY, "--train-data-path", str(data)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == [
        "error: 22 bad line(s) in the fine-tuning data; fix or remove them:",
        f'{data}:1: needs "prompt" and "response", or "messages" (or Alpaca\'s "instruction" and "output", or '
        f'ShareGPT\'s "conversations"); the record has keys [\'conversation\']: rename columns with --sft-data-keys '
        f'NAME=COLUMN (20 lines alike: 1, 2, 3, 4, 5, ...)',
        f"{data}:21: the last message must be the assistant's (the response the loss trains on) (2 lines alike: "
        f"21, 22)"]
    assert " model: " not in captured.out  # the start-up summary (and the model build) never came
    data.write_text("".join(json.dumps({"conversation": TURNS}) + "\n" for _ in range(3)))
    assert pretrain_gpt.main([*TINY, "--train-data-path", str(data), "--sft-data-keys",
                              "conversations=conversation"]) == 0  # the rename the line suggests
