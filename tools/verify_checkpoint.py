"""Check a checkpoint without training: every file against its recorded size and SHA-256, every tensor read back.

    python tools/verify_checkpoint.py --load ckpt                   # the newest (latest_checkpointed_iteration.txt)
    python tools/verify_checkpoint.py --load ckpt/iter_0000200      # one iteration
    python tools/verify_checkpoint.py --load ckpt --all-iterations  # each iter_* (which to fall back to)

Prints one ``ok:`` line per sound checkpoint and one ``error:`` line naming the file for each bad one;
exits 0 when all are sound, 2 otherwise.
"""
from __future__ import annotations

import sys

from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.checkpointing.verify import checkpoints_to_verify, verify_checkpoint
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.config import ConfigError


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="a checkpoint root (--save directory) or one iter_* directory")
    parser.add_argument("--all-iterations", action="store_true",
                        help="check every iter_* directory of the root, not only the newest")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        directories = checkpoints_to_verify(args.load, all_iterations=args.all_iterations)
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    status = 0
    for directory in directories:
        try:
            print(f"ok: {verify_checkpoint(directory)}", flush=True)
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
