"""Train a tokenizer from text or JSONL, so nothing has to be downloaded.

    python tools/train_tokenizer.py --input corpus.jsonl --tokenizer-type GPT2BPETokenizer \
        --vocab-size 8192 --output-dir tokenizer/        # -> vocab.json + merges.txt
    python tools/train_tokenizer.py --input book.txt --tokenizer-type SentencePieceTokenizer \
        --vocab-size 8192 --output-dir tokenizer/        # -> tokenizer.model

Files ending in .jsonl or .json are read as one JSON object per line (--json-keys);
anything else is plain text, one document per file.
"""
import argparse
import itertools
import json
import os
import sys

from megatron_lite.config import ConfigError
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe
from megatron_lite.tokenizer.sentencepiece_tokenizer import train_sentencepiece


def read_texts(paths: list[str], json_keys: list[str]):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if not path.endswith((".jsonl", ".json")):
                yield f.read()
                continue
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    print(f"{path}:{line_number}: malformed JSON ({error.msg}); skipped", file=sys.stderr)
                    continue
                yield from (record[key] for key in json_keys if isinstance(record.get(key), str))


def main(argv=None) -> int:
    # One `error:` line naming the flag (and the nearest known one), not argparse's usage block.
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--tokenizer-type", required=True, choices=["GPT2BPETokenizer", "SentencePieceTokenizer"])
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--sentencepiece-model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--output-dir", required=True)
    try:
        args = parser.parse_args(argv)
        for path in args.input:
            if not os.path.isfile(path):
                raise ConfigError(f"--input {path} is not a file")
        print(train(args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def train(args) -> str:
    """Trains the tokenizer; returns the flags that name it."""
    texts = read_texts(args.input, args.json_keys)
    first = next(texts, None)
    if first is None:  # a wrong --json-keys would otherwise train on nothing (BPE) or fail inside SentencePiece
        raise ConfigError(f"no text in --input {' '.join(args.input)} under --json-keys {' '.join(args.json_keys)}; "
                          f"give the keys that hold the documents' text.")
    texts = itertools.chain([first], texts)
    if args.tokenizer_type == "GPT2BPETokenizer":
        vocab_file, merge_file = save_gpt2_bpe_files(*train_byte_level_bpe(texts, args.vocab_size), args.output_dir)
        return f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab_file} --merge-file {merge_file}"
    os.makedirs(args.output_dir, exist_ok=True)
    model = train_sentencepiece(texts, os.path.join(args.output_dir, "tokenizer"), args.vocab_size,
                                model_type=args.sentencepiece_model_type)
    return f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {model}"


if __name__ == "__main__":
    sys.exit(main())
