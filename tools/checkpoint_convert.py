"""Convert checkpoints offline: reshard a megatron_lite checkpoint, or import/export Hugging Face models.

    # another tensor/pipeline layout (optimizer state included)
    python tools/checkpoint_convert.py --load-dir ckpt --save-dir ckpt_tp4 \\
        --target-tensor-parallel-size 4 --target-pipeline-parallel-size 1

    # a local GPT2LMHeadModel / LlamaForCausalLM directory -> megatron_lite (weights only, iteration 0)
    python tools/checkpoint_convert.py --source-format hf --target-format megatron_lite \\
        --load-dir llama-dir --save-dir ckpt --target-tensor-parallel-size 2

    # megatron_lite (any layout) -> a directory transformers' from_pretrained loads
    python tools/checkpoint_convert.py --source-format megatron_lite --target-format hf \\
        --load-dir ckpt --save-dir hf-dir

One process is enough: checkpoints name tensors by global name, so resharding is
reading whole tensors and cutting them again. ``--load-dir`` may be a checkpoint
root (its newest iteration) or one ``iter_*`` directory.
"""
from __future__ import annotations

import argparse
import sys

from megatron_lite.checkpointing import hf_interop
from megatron_lite.checkpointing.offline import reshard_checkpoint
from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.config import ConfigError

FORMATS = ("megatron_lite", "hf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load-dir", required=True,
                        help="source: a checkpoint root or iter_* directory, or a Hugging Face model directory")
    parser.add_argument("--save-dir", required=True, help="where to write the converted checkpoint")
    parser.add_argument("--source-format", choices=FORMATS, default="megatron_lite")
    parser.add_argument("--target-format", choices=FORMATS, default="megatron_lite")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    group = parser.add_argument_group("tokenizer of an HF export (default: the one the checkpoint was trained with)")
    group.add_argument("--tokenizer-type")
    group.add_argument("--vocab-file")
    group.add_argument("--merge-file")
    group.add_argument("--tokenizer-model")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}.", file=sys.stderr)
            return 2
    sizes = dict(tensor_model_parallel_size=args.target_tensor_parallel_size,
                 pipeline_model_parallel_size=args.target_pipeline_parallel_size)
    try:
        if args.source_format == "hf" and args.target_format == "megatron_lite":
            written = hf_interop.import_hf_checkpoint(args.load_dir, args.save_dir, **sizes)
        elif args.source_format == "megatron_lite" and args.target_format == "hf":
            tokenizer = {k: getattr(args, k) for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")}
            hf_interop.export_hf_checkpoint(args.load_dir, args.save_dir, tokenizer_flags=tokenizer)
            written = args.save_dir
        elif args.source_format == "megatron_lite":
            written = reshard_checkpoint(args.load_dir, args.save_dir, **sizes)
        else:
            print("error: --source-format hf needs --target-format megatron_lite.", file=sys.stderr)
            return 2
    except (CheckpointError, ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
