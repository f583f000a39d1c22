"""Build the bundled demo corpus (Python's documentation topics), its tokenizer and dataset.

    python tools/build_demo_data.py --output-dir demo_data

Takes a few seconds, downloads nothing, and skips work whose outputs already exist.

``pydoc_data.topics`` ships with every CPython (about 460 KB of the language reference,
under the Python Software Foundation licence). Each topic is cut at paragraph boundaries
into documents of about a kilobyte, a byte-level BPE is trained on them, and they are
preprocessed into ``{output_dir}/demo_text_document.bin/.idx``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.files import atomic_write
from megatron_lite.data.indexed_dataset import data_file_path, index_file_path, output_prefix_for
from megatron_lite.data.preprocess import preprocess_jsonl
from megatron_lite.process_groups.failures import run_command
from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe

DEMO_VOCAB_SIZE = 4096  # a multiple of 128, so Megatron's vocabulary padding leaves it unchanged at tp=1
_DOCUMENT_CHARS = 1000


def demo_documents() -> list[str]:
    """The standard library's documentation topics, in name order, cut into ~1 KB documents."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        paragraphs, size = [], 0
        for paragraph in topics[name].split("\n\n"):
            if not paragraph.strip():
                continue
            paragraphs.append(paragraph)
            size += len(paragraph)
            if size >= _DOCUMENT_CHARS:
                documents.append("\n\n".join(paragraphs))
                paragraphs, size = [], 0
        if paragraphs:
            documents.append("\n\n".join(paragraphs))
    return documents


def build_demo_data(output_dir: str, *, vocab_size: int = DEMO_VOCAB_SIZE, workers: int = 1, log=None) -> dict:
    """Builds (or reuses) the demo tokenizer and dataset; returns the training flags as {flag: value}.

    Every step is skipped when its output already exists, so rerunning is instant.
    """
    os.makedirs(output_dir, exist_ok=True)
    tokenizer_dir = os.path.join(output_dir, "tokenizer")
    vocab_file, merge_file = os.path.join(tokenizer_dir, "vocab.json"), os.path.join(tokenizer_dir, "merges.txt")
    documents = None
    if not (os.path.isfile(vocab_file) and os.path.isfile(merge_file)):
        documents = demo_documents()
        save_gpt2_bpe_files(*train_byte_level_bpe(documents, vocab_size), tokenizer_dir)

    output_prefix = os.path.join(output_dir, "demo")
    data_prefix = output_prefix_for(output_prefix, "text")
    if not (os.path.isfile(data_file_path(data_prefix)) and os.path.isfile(index_file_path(data_prefix))):
        jsonl = os.path.join(output_dir, "demo_corpus.jsonl")
        with atomic_write(jsonl) as f:
            for document in documents or demo_documents():
                f.write(json.dumps({"text": document}) + "\n")
        preprocess_jsonl([jsonl], output_prefix=output_prefix, append_eod=True, workers=workers, log=log,
                         tokenizer_kwargs=dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                                               merge_file=merge_file))
    return {"--data-path": data_prefix, "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": vocab_file,
            "--merge-file": merge_file}


def main(argv=None) -> int:
    return run_command(build, argv)


def build(argv) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--output-dir", default="demo_data")
    parser.add_argument("--vocab-size", type=int, default=DEMO_VOCAB_SIZE)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    flags = build_demo_data(args.output_dir, vocab_size=args.vocab_size, workers=args.workers)
    print("train on it with:\n  " + " ".join(f"{flag} {value}" for flag, value in flags.items()))


if __name__ == "__main__":
    sys.exit(main())
