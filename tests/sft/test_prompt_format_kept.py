"""A fine-tuning run that continues a chat checkpoint keeps its chat template (issue 22, item 1).

Found by a reliability pass: an SFT run resumed with --load and no --sft-tokenizer-prompt-format fell
back to plain (the loss jumped 0.79 -> 7.74) and saved the damaged model as its newest checkpoint.
"""
import json

from megatron_lite.pretrain_gpt import main as pretrain_main

CHAT = [{"messages": [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "be nice"}]},
        {"prompt": "the question was", "response": "the answer is 4"}]


def _run_flags(chat_tokenizer_dir, data):
    return ["--sft", "--train-data-path", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            chat_tokenizer_dir, "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--eval-interval", "100", "--eval-iters", "1",
            "--no-log-memory", "--log-interval", "1", "--lr-decay-iters", "4"]


def _saved_format(root, iteration):
    metadata = json.loads((root / f"iter_{iteration:07d}" / "metadata.json").read_text())
    return metadata["config"]["data"]["sft_tokenizer_prompt_format"]


def test_resume_and_pretrained_checkpoint_keep_the_chat_template(chat_tokenizer_dir, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    flags, ckpt = _run_flags(chat_tokenizer_dir, str(data)), tmp_path / "ckpt"
    assert pretrain_main([*flags, "--sft-tokenizer-prompt-format", "chatml", "--train-iters", "2",
                          "--save", str(ckpt)]) == 0
    capsys.readouterr()
    # Resumed with no format flag: the checkpoint's, and said so.
    assert pretrain_main([*flags, "--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt)]) == 0
    assert "--sft-tokenizer-prompt-format chatml" in capsys.readouterr().out
    assert _saved_format(ckpt, 3) == "chatml"
    # A new run from it as --pretrained-checkpoint takes it too.
    other = tmp_path / "other"
    assert pretrain_main([*flags, "--train-iters", "1", "--pretrained-checkpoint", str(ckpt),
                          "--save", str(other)]) == 0
    assert _saved_format(other, 1) == "chatml"
    # A resume naming another format is refused by name; --finetune starts anew with it.
    capsys.readouterr()
    assert pretrain_main([*flags, "--sft-tokenizer-prompt-format", "plain", "--train-iters", "4",
                          "--load", str(ckpt), "--save", str(ckpt)]) == 2
    assert ("error: --sft-tokenizer-prompt-format plain differs from chatml, the format the checkpoint in --load "
            f"{ckpt} was fine-tuned with") in capsys.readouterr().err
    assert pretrain_main([*flags, "--sft-tokenizer-prompt-format", "plain", "--finetune", "--train-iters", "1",
                          "--load", str(ckpt), "--save", str(tmp_path / "anew")]) == 0
    assert _saved_format(tmp_path / "anew", 1) == "plain"
