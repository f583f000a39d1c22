"""--peft from the command line: the start-up line counts trainable and total parameters, the memory
report shows gradient and optimizer bytes for the added weights only, and bad values are one error."""
import re

import pytest

from megatron_lite.pretrain_gpt import main as pretrain_gpt

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--eval-iters", "1"]


def _memory(output: str) -> dict:
    line = next(line for line in output.splitlines() if "memory per rank (MB)" in line)
    return {k: float(v) for k, v in re.findall(r"(parameters|gradients|optimizer state): ([\d.]+)", line)}


@pytest.mark.parametrize("method, flags, trainable", [
    # LoRA r=4 on qkv (64 -> 192) and fc2 (256 -> 64): 4 x (64 + 192) + 4 x (256 + 64) per layer.
    ("lora", ["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "linear_fc2"], 2 * (1024 + 1280)),
    # Two adapters of width 8 per layer: 2 x (64 x 8 + 8 + 8 x 64 + 64).
    ("adapter", ["--adapter-dim", "8"], 2 * 2 * 1096),
    # Prefixes of 5 keys and values over 4 heads of 16: 5 x 2 x 64 per layer.
    ("prefix", ["--prefix-length", "5"], 2 * 640),
], ids=["lora", "adapter", "prefix"])
def test_start_up_line_counts_trainable_parameters(capsys, method, flags, trainable):
    assert pretrain_gpt(MODEL + ["--peft", method, *flags, "--peft-without-base-checkpoint"]) == 0
    output = capsys.readouterr().out
    base = 2 * (4 * 64 * 64 + 4 * 64 + 2 * 64 * 256 + 256 + 64 + 4 * 64) + 128 * 64 + 16 * 64 + 2 * 64
    total = base + trainable
    assert f" model: {total:,} parameters, {trainable:,} of them trainable ({100 * trainable / total:.2f}%, " \
           f"--peft {method}; the base is frozen)" in output
    memory = _memory(output)
    mb = {"gradients": 4 * trainable, "optimizer state": 8 * trainable, "parameters": 4 * total}  # Adam: 2 moments
    assert memory == pytest.approx({k: v / 2 ** 20 for k, v in mb.items()}, rel=1e-2)


@pytest.mark.parametrize("flags, message", [
    (["--peft", "lora", "--lora-target-modules", "linear_q"], "argument --lora-target-modules: invalid choice"),
    (["--peft", "bitfit"], "argument --peft: invalid choice"),
    (["--peft", "lora", "--lora-rank", "0"], "--lora-rank must be >= 1"),
    (["--peft", "prefix", "--prefix-length", "0"], "--prefix-length must be >= 1"),
])
def test_bad_peft_flags_are_one_error(capsys, flags, message):
    assert pretrain_gpt(MODEL + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
