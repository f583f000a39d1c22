"""Write --grpo's worked example: sums of two digits to answer, and the reward that checks the answers.

    python tools/build_grpo_demo_data.py --output-dir data/sums

writes prompts.jsonl, {"prompt": "a + b =", "answer": "c"} lines for --tokenizer-type NullTokenizer (text is
space-separated ids: digits are ids 0-9, "+" is 10 and "=" 11, the EOD 12, so the model has --vocab-size 13),
every pair a, b whose sum is one digit; answers.jsonl, the same as {"prompt", "response"} for
``megatron_lite.evaluate --sft --exact-match``; and rewards.py, whose ``correct`` gives 1 to a completion that is
the answer (then EOD) and ``starts_right`` 0.5 to one that begins with it: TRL's accuracy reward for math
answers. docs/fine_tuning.md trains on it.
"""
from __future__ import annotations

import json
import os
import sys

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.process_groups.failures import run_command

PLUS, EQUALS = 10, 11
VOCAB_SIZE = 13  # ids 0-11 data, 12 EOD (NullTokenizer's EOD is the vocabulary's last id)
REWARDS = '''"""Rewards for tools/build_grpo_demo_data.py's sums (TRL's signature: one float per completion)."""


def correct(prompts, completions, answer, **kwargs):
    return [1.0 if completion.split() == [right] else 0.0 for completion, right in zip(completions, answer)]


def starts_right(prompts, completions, answer, **kwargs):
    return [0.5 if completion.split()[:1] == [right] else 0.0 for completion, right in zip(completions, answer)]
'''


def sum_prompts() -> list[dict]:
    """Every "a + b =" with a + b <= 9, and its answer."""
    return [{"prompt": f"{a} {PLUS} {b} {EQUALS}", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]


def write(output_dir: str) -> dict:
    os.makedirs(output_dir, exist_ok=True)
    paths = {name: os.path.join(output_dir, name) for name in ("prompts.jsonl", "answers.jsonl", "rewards.py")}
    with open(paths["prompts.jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in sum_prompts())
    with open(paths["answers.jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": r["prompt"], "response": r["answer"]}) + "\n" for r in sum_prompts())
    with open(paths["rewards.py"], "w", encoding="utf-8") as f:
        f.write(REWARDS)
    return paths


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--output-dir", required=True)
    return run_command(lambda: print("\n".join(f"{name}: {path}" for name, path in
                                               write(parser.parse_args(argv).output_dir).items())))


if __name__ == "__main__":
    sys.exit(main())
