"""Preprocessing throughput (tokens/s) of tools/preprocess_data.py's engine, by tokenizer and worker count.

    python bench/bench_preprocess.py [--repeat 8] [--workers 1 2] [--trials 3]

The corpus is the bundled demo text (Python's documentation topics) repeated --repeat
times; the tokenizers (GPT-2 byte-level BPE and SentencePiece BPE, 4,096 entries) are
trained on it first. Numbers include reading JSON, tokenizing and writing .bin/.idx;
each is the fastest of --trials runs, since other processes on a shared machine only slow a run down.
The last column, the tokenizer alone in this process per CPU-second, does not depend on machine load.
"""
import argparse
import json
import os
import sys
import tempfile
import time

from megatron_lite.data.preprocess import preprocess_jsonl
from megatron_lite.tokenizer import build_tokenizer
from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe
from megatron_lite.tokenizer.sentencepiece_tokenizer import train_sentencepiece

# tools/ is not installed with the package: run as a script, the repo root is not on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.build_demo_data import demo_documents  # noqa: E402


def tokens_per_cpu_second(tokenizer_kwargs: dict, documents: list[str]) -> float:
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    start = time.process_time()
    tokens = sum(len(tokenizer.tokenize(d)) for d in documents)
    return tokens / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=8, help="copies of the ~460 KB demo corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

    documents = demo_documents()
    with tempfile.TemporaryDirectory() as work:
        vocab_file, merge_file = save_gpt2_bpe_files(*train_byte_level_bpe(documents, 4096), work)
        sentencepiece_model = train_sentencepiece(documents, os.path.join(work, "sp"), 4096)
        corpus = os.path.join(work, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            for _ in range(args.repeat):
                f.writelines(json.dumps({"text": d}) + "\n" for d in documents)
        megabytes = os.path.getsize(corpus) / 1e6
        tokenizers = {
            "GPT2BPETokenizer": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file),
            "SentencePieceTokenizer": dict(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=sentencepiece_model),
        }
        print(f"corpus: {len(documents) * args.repeat} documents, {megabytes:.1f} MB, {os.cpu_count()} CPUs")
        print(f"{'tokenizer':<24}{'workers':>8}{'tokens':>12}{'seconds':>9}{'tokens/s':>12}{'MB/s':>7}"
              f"{'alone, tokens/CPU-s':>21}")
        with open(os.devnull, "w") as quiet:
            for name, kwargs in tokenizers.items():
                alone = tokens_per_cpu_second(kwargs, documents * 2)
                for workers in args.workers:
                    stats = min((preprocess_jsonl([corpus], output_prefix=os.path.join(work, f"{name}_{workers}"),
                                                  tokenizer_kwargs=kwargs, append_eod=True, workers=workers,
                                                  log=quiet) for _ in range(args.trials)),
                                key=lambda s: s.seconds)
                    print(f"{name:<24}{workers:>8}{stats.tokens:>12}{stats.seconds:>9.2f}"
                          f"{stats.tokens / stats.seconds:>12,.0f}{megabytes / stats.seconds:>7.2f}"
                          f"{alone:>21,.0f}")


if __name__ == "__main__":
    main()
