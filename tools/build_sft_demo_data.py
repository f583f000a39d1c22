"""Write a fine-tuning task a random model cannot do: reverse a short string of letters.

    python tools/build_sft_demo_data.py --output-dir data/reverse

writes train.jsonl, valid.jsonl and test.jsonl of {"prompt", "response"} lines for
--tokenizer-type NullTokenizer (text is space-separated ids): letters are ids 1 to 8, the prompt is
the string then the separator 9, the response the string reversed. Test strings never occur in
train. docs/fine_tuning.md trains on it and measures exact match with megatron_lite.evaluate.
"""
from __future__ import annotations

import json
import os
import random
import sys

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.process_groups.failures import run_command

LETTERS = range(1, 9)
SEPARATOR = 9
# NullTokenizer's ids are below the model vocabulary's last id (its EOD): ids 0-10 data, 11 EOD.
VOCAB_SIZE = 12


def reversal_examples(count: int, *, seed: int, min_length: int = 3, max_length: int = 6,
                      exclude: set | None = None, task: str = "reverse") -> list[dict]:
    """``count`` distinct {"prompt", "response"} records, none of whose strings are in ``exclude``; with
    ``task="copy"`` the response is the string itself (a base model for parameter-efficient fine-tuning)."""
    rng, seen, records = random.Random(seed), set(exclude or ()), []
    while len(records) < count:
        letters = tuple(rng.choice(LETTERS) for _ in range(rng.randint(min_length, max_length)))
        if letters in seen:
            continue
        seen.add(letters)
        records.append({"prompt": " ".join(map(str, letters + (SEPARATOR,))),
                        "response": " ".join(map(str, reversed(letters) if task == "reverse" else letters))})
    return records


def _letters(record: dict) -> tuple:
    return tuple(int(x) for x in record["prompt"].split()[:-1])


def write_splits(output_dir: str, *, train: int = 4000, valid: int = 100, test: int = 100, seed: int = 0,
                 task: str = "reverse") -> dict:
    """Writes the three JSONL files; returns {split: path}. Both tasks hold out the same strings."""
    os.makedirs(output_dir, exist_ok=True)
    held_out = reversal_examples(valid + test, seed=seed + 1, task=task)
    splits = {"train": reversal_examples(train, seed=seed, exclude={_letters(r) for r in held_out}, task=task),
              "valid": held_out[:valid], "test": held_out[valid:]}
    paths = {}
    for name, records in splits.items():
        paths[name] = os.path.join(output_dir, f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
    return paths


def main(argv=None) -> int:
    return run_command(build, argv)


def build(argv) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train-examples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, path in write_splits(args.output_dir, train=args.train_examples, seed=args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    sys.exit(main())
