"""Build the bundled demo corpus (Python's documentation topics), its tokenizer and dataset.

    python tools/build_demo_data.py --output-dir demo_data

Takes a few seconds, downloads nothing, and skips work whose outputs already exist.
"""
import argparse
import sys

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.data.demo_corpus import DEMO_VOCAB_SIZE, build_demo_data
from megatron_lite.process_groups.failures import run_command


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
