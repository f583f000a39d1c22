"""Concatenate indexed datasets (.bin/.idx pairs) into one, keeping document boundaries.

    python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document

--input takes directories (every pair inside, in name order) and/or prefixes.
"""
import argparse
import os
import sys

from megatron_lite.config import ConfigError
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, data_file_path, index_file_path
from megatron_lite.process_groups.failures import run_command


def input_prefixes(inputs: list[str]) -> list[str]:
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            names = sorted(name[:-len(".idx")] for name in os.listdir(item) if name.endswith(".idx"))
            prefixes += [os.path.join(item, name) for name in names]
        else:
            prefixes.append(item)
    return prefixes


def main(argv=None) -> int:
    return run_command(merge, argv)


def merge(argv) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True, help="directories and/or dataset prefixes")
    parser.add_argument("--output-prefix", required=True)
    args = parser.parse_args(argv)
    prefixes = input_prefixes(args.input)
    if not prefixes:
        raise ConfigError(f"no .idx files found in --input {args.input}")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(data_file_path(args.output_prefix), dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(args.output_prefix))
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}")


if __name__ == "__main__":
    sys.exit(main())
