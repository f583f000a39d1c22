"""End to end, through the two commands docs/fine_tuning.md shows: fine-tune a small GPT from scratch with --sft
on a task a random model cannot do (reverse 3-6 letters: 1 chance in 8^3 or less per answer), then
measure greedy exact match on held-out strings with megatron_lite.evaluate (measured: 100 of 100)."""
import json

from megatron_lite.evaluate import main as evaluate_main
from megatron_lite.pretrain_gpt import main as pretrain_main
from tools.build_sft_demo_data import VOCAB_SIZE, write_splits

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
TRAINING = ["--micro-batch-size", "32", "--global-batch-size", "32", "--train-iters", "300", "--lr", "3e-3",
            "--min-lr", "3e-4", "--lr-warmup-iters", "20", "--weight-decay", "0", "--log-interval", "100",
            "--eval-interval", "300", "--eval-iters", "2", "--no-log-memory"]


def test_fine_tuning_reverses_strings_it_never_saw(tmp_path, capsys):
    data = write_splits(str(tmp_path / "data"))
    checkpoint, answers = str(tmp_path / "ckpt"), str(tmp_path / "answers.jsonl")
    tokenizer = ["--tokenizer-type", "NullTokenizer"]
    assert pretrain_main(["--sft", "--train-data-path", data["train"], "--valid-data-path", data["valid"],
                          "--vocab-size", str(VOCAB_SIZE), *tokenizer, *MODEL, *TRAINING, "--save", checkpoint]) == 0
    assert evaluate_main(["--load", checkpoint, *tokenizer, "--sft", "--data-path", data["test"], "--exact-match",
                          "--max-new-tokens", "8", "--output-file", answers]) == 0
    results = [json.loads(line) for line in open(answers)]
    matches = sum(r["exact_match"] for r in results)
    assert len(results) == 100 and matches >= 90, [r for r in results if not r["exact_match"]][:5]
    assert all(r["exact_match"] == (r["response"] == r["reference"]) for r in results)
    assert f"exact match: {matches / 100:.4f} ({matches} of 100)" in capsys.readouterr().out
