"""Throughput counts the tokens trained on: an --sft sample's padding is no token (docs/training.md's legend)."""
import json
import re

import numpy as np

from megatron_lite import pretrain_gpt
from megatron_lite.data.sft import SFTDataset, load_sft_examples
from megatron_lite.tokenizer import build_tokenizer

THROUGHPUT = re.compile(r"^ tokens per second: ([0-9.]+) \| consumed tokens: (\d+) \|", re.MULTILINE)


def test_tokens_per_second_and_consumed_tokens_leave_out_padding(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(map(str, range(1, i % 4 + 2))), "response": "9 8"}) + "\n"
                            for i in range(6)))
    assert pretrain_gpt.main(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                              "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
                              "--vocab-size", "64", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0",
                              "--sft", "--tokenizer-type", "NullTokenizer", "--train-data-path", str(data)]) == 0
    output = capsys.readouterr().out
    consumed = [int(n) for _, n in THROUGHPUT.findall(output)]
    per_second = [float(rate) for rate, _ in THROUGHPUT.findall(output)]
    elapsed_s = [float(ms) / 1000 for ms in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", output)]
    # The samples the run read, in its order: NullTokenizer pads with its EOD, which no input position holds
    # (an example's EOD is only ever a label), so the positions that are not padding are counted directly.
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=63)
    dataset = SFTDataset(load_sft_examples([str(data)], tokenizer, "plain"), seq_length=16, num_samples=6,
                         seed=1234, pad_token=tokenizer.pad)
    real = np.cumsum([int((dataset[i]["tokens"] != tokenizer.pad).sum()) for i in range(6)])
    assert consumed == [int(real[1]), int(real[3]), int(real[5])]
    # Each line's rate is its iteration's tokens over its time (the printed time is rounded to 0.1 ms).
    tokens = np.diff([0, *consumed])
    assert np.allclose(np.asarray(per_second) * np.asarray(elapsed_s), tokens, rtol=0.02)
    assert f" training finished: 3 iterations (1-3) | tokens: {consumed[-1]:,} |" in output  # the closing line too
    assert consumed[-1] < 6 * 16 / 2  # every example is under half the sequence: padding counted would double it
