"""Runs that would train on nothing stop with one error, or say there is nothing to do (issue 22, item 6).

Found by a reliability pass: each of these exited 0 having trained nothing useful (or damaged a base).
"""
import json

from megatron_lite.checkpointing import storage
from megatron_lite.pretrain_gpt import main as pretrain_main

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval", "100", "--eval-iters", "1",
         "--no-log-memory"]
MOCK = [*MODEL, "--mock-data", "--vocab-size", "64"]


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_fine_tuning_data_whose_every_prompt_fills_the_sequence(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(["1"] * 12), "response": "2"}) + "\n" for _ in range(3)))
    assert pretrain_main([*MODEL, "--sft", "--train-data-path", str(data), "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "51"]) == 2
    assert _errors(capsys) == ["error: every one of the 3 fine-tuning examples is longer than --seq-length + 1 = 9 "
                               "tokens with a prompt that fills the sequence: none has a response token to learn "
                               "from. Raise --seq-length or shorten the prompts."]


def test_peft_without_a_base_checkpoint_needs_the_flag(capsys):
    assert pretrain_main([*MOCK, "--peft", "lora"]) == 2
    (error,) = _errors(capsys)
    assert "the base would be random weights" in error and "--peft-without-base-checkpoint" in error
    assert pretrain_main([*MOCK, "--peft", "lora", "--peft-without-base-checkpoint"]) == 0


def test_saving_into_the_pretrained_checkpoint_and_rerunning_a_finished_run(tmp_path, capsys):
    base = str(tmp_path / "base")
    assert pretrain_main([*MOCK, "--save", base]) == 0
    capsys.readouterr()
    assert pretrain_main([*MOCK, "--peft", "lora", "--pretrained-checkpoint", base, "--save", base + "/"]) == 2
    (error,) = _errors(capsys)
    assert error.startswith(f"error: --save {base}/ is the --pretrained-checkpoint directory")
    assert storage.read_latest_iteration(base) == 2
    # The same finished command again: it says so, and saves nothing new.
    assert pretrain_main([*MOCK, "--save", base, "--load", base]) == 0
    assert (" already at --train-iters 2 (the checkpoint is at iteration 2); nothing to do."
            in capsys.readouterr().out)


def test_exporting_a_prefix_checkpoint_says_what_it_can_become(tmp_path, capsys):
    """Item 11: the export suggested --merge-lora and --target-format peft, which both refuse prefix tuning."""
    from tools.checkpoint_convert import main as convert

    ckpt = str(tmp_path / "prefix")
    assert pretrain_main([*MOCK, "--peft", "prefix", "--prefix-length", "2", "--peft-without-base-checkpoint",
                          "--save", ckpt]) == 0
    capsys.readouterr()
    assert convert(["--load-dir", ckpt, "--save-dir", str(tmp_path / "hf"), "--target-format", "hf"]) == 1
    (error,) = _errors(capsys)
    assert "is a --peft prefix checkpoint, which has no Hugging Face form" in error
    assert "--fold-prefix-projection" in error and "--merge-lora" in error
