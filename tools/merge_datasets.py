"""Concatenate indexed datasets (.bin/.idx pairs) into one, keeping document boundaries.

    python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document

--input takes directories (every pair inside, in name order) and/or prefixes.
"""
import argparse
import os
import sys

from megatron_lite.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                                                data_file_path, index_file_path)


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="directories and/or dataset prefixes")
    parser.add_argument("--output-prefix", required=True)
    args = parser.parse_args(argv)
    prefixes = input_prefixes(args.input)
    if not prefixes:
        print(f"error: no .idx files found in --input {args.input}", file=sys.stderr)
        return 1
    try:
        dtype = IndexedDataset(prefixes[0]).dtype
        with IndexedDatasetBuilder(data_file_path(args.output_prefix), dtype) as builder:
            for prefix in prefixes:
                builder.add_index(prefix)
            builder.finalize(index_file_path(args.output_prefix))
    except (IndexedDatasetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
