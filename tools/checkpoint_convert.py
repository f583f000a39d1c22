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

    # a LoRA adapter checkpoint merged into its base (W + alpha/r B A), then any target format
    python tools/checkpoint_convert.py --merge-lora --target-format hf --load-dir lora-ckpt --save-dir hf-dir

    # prefix tuning's reparametrising MLP replaced by the prefixes it computes
    python tools/checkpoint_convert.py --fold-prefix-projection --load-dir prefix-ckpt --save-dir prefix-folded

    # a Megatron-LM checkpoint (--ckpt-format torch or torch_dist, any TP/PP) -> megatron_lite at any layout
    python tools/checkpoint_convert.py --source-format megatron --load-dir megatron-ckpt --save-dir ckpt \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

    # megatron_lite (any layout) -> a Megatron-LM checkpoint at any TP/PP: legacy (--ckpt-format torch) or
    # torch_dist (--megatron-common-state distcp: the common state inside the .distcp, as core >= 0.19 writes)
    python tools/checkpoint_convert.py --target-format megatron --megatron-ckpt-format torch \\
        --load-dir ckpt --save-dir megatron-ckpt --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint_convert.py --target-format megatron --megatron-ckpt-format torch_dist \\
        --load-dir ckpt --save-dir megatron-ckpt --target-tensor-parallel-size 2

    # LoRA adapters <-> a Hugging Face PEFT directory (adapter_config.json, adapter_model.safetensors)
    python tools/checkpoint_convert.py --target-format peft --load-dir lora-ckpt --save-dir peft-dir
    python tools/checkpoint_convert.py --source-format peft --load-dir peft-dir --save-dir lora-ckpt \\
        --base-checkpoint ckpt

    # any other pair in one command, through megatron_lite's format in a scratch directory beside --save-dir:
    # Megatron-LM <-> Hugging Face, Hugging Face as another family, Megatron-LM at another TP/PP, LoRA or PEFT
    # adapters merged into their base and written as megatron_lite, hf or megatron
    python tools/checkpoint_convert.py --source-format megatron --target-format hf --load-dir megatron-ckpt \
        --save-dir hf-dir
    python tools/checkpoint_convert.py --source-format peft --merge-lora --target-format hf --load-dir peft-dir \
        --base-checkpoint ckpt --save-dir hf-dir

One process is enough: checkpoints name tensors by global name, so resharding is
reading whole tensors and cutting them again. ``--load-dir`` may be a checkpoint
root (its newest iteration) or one ``iter_*`` directory.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile

from megatron_lite.interop.hf import peft as hf_peft
from megatron_lite.interop.hf import checkpoint as hf_checkpoint
from megatron_lite.interop.hf.families import FAMILIES
from megatron_lite.interop.megatron import torch_dist
from megatron_lite.interop.megatron.exporter import CKPT_FORMATS, export_megatron_checkpoint
from megatron_lite.interop.megatron.importer import import_megatron_checkpoint
from megatron_lite.checkpointing.offline import reshard_checkpoint, write_checkpoint
from megatron_lite.checkpointing.peft_base import folded_prefix, merged_lora
from megatron_lite.checkpointing.storage import CheckpointError, check_is_directory, resolve_checkpoint_dir
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.cli.parser import ArgumentParser

FORMATS = ("megatron_lite", "hf", "peft", "megatron")


def build_parser() -> argparse.ArgumentParser:
    # One `error:` line naming the flag (and the nearest known one), not argparse's usage block.
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load-dir", required=True,
                        help="source: a checkpoint root or iter_* directory (ours or Megatron-LM's), or a Hugging Face "
                             "model directory")
    parser.add_argument("--save-dir", required=True, help="where to write the converted checkpoint")
    parser.add_argument("--source-format", choices=FORMATS, default="megatron_lite")
    parser.add_argument("--target-format", choices=FORMATS, default="megatron_lite")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--target-expert-parallel-size", type=int, default=1,
                        help="with --target-format megatron: the expert-parallel ranks a mixture of experts is split "
                             "over (Megatron-LM's --expert-model-parallel-size; its files mp_rank_*_EEE)")
    parser.add_argument("--hf-model-type", choices=sorted(FAMILIES),
                        help="the Hugging Face family an hf or peft export is written as (default: the one the "
                             "model's features call for; phi3 fuses q/k/v and gate/up)")
    parser.add_argument("--megatron-ckpt-format", choices=CKPT_FORMATS, default="torch",
                        help="with --target-format megatron: the format written, Megatron-LM's --ckpt-format "
                             "(torch: the legacy mp_rank_* files; torch_dist: torch.distributed.checkpoint files)")
    parser.add_argument("--megatron-common-state", choices=torch_dist.COMMON_STATE_LAYOUTS,
                        help="with --megatron-ckpt-format torch_dist: where the args and iteration go: common.pt "
                             "(the default: Megatron-Core up to 0.18 writes it, every version reads it) or distcp "
                             "(inside the .distcp files, as Megatron-Core 0.19 and later write them)")
    lora = parser.add_argument_group("adapter checkpoints (--peft)")
    lora.add_argument("--merge-lora", action="store_true",
                      help="merge the adapters of a LoRA checkpoint into its base and write the merged model")
    lora.add_argument("--fold-prefix-projection", action="store_true",
                      help="replace a prefix-tuning checkpoint's reparametrising MLP by the prefixes it computes")
    lora.add_argument("--base-checkpoint",
                      help="with --source-format peft: the megatron_lite checkpoint of the adapters' base model")
    lora.add_argument("--base-model-name-or-path",
                      help="with --target-format peft: recorded in adapter_config.json (the Hugging Face base; "
                           "default: the directory the base checkpoint was imported from)")
    group = parser.add_argument_group("tokenizer of an HF export (default: the one the checkpoint was trained with)")
    group.add_argument("--tokenizer-type")
    group.add_argument("--vocab-file")
    group.add_argument("--merge-file")
    group.add_argument("--tokenizer-model")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size),
                        ("--target-expert-parallel-size", args.target_expert_parallel_size)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}.", file=sys.stderr)
            return 2
    sizes = dict(tensor_model_parallel_size=args.target_tensor_parallel_size,
                 pipeline_model_parallel_size=args.target_pipeline_parallel_size)
    try:
        check_is_directory(args.load_dir, "--load-dir")  # every source format is a directory
        written = _convert(args, sizes)
    except (CheckpointError, ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def _convert(args, sizes: dict) -> str:
    """Every pair of formats: an import into megatron_lite's format, an export from it, or both in turn."""
    source, target = args.source_format, args.target_format
    if args.merge_lora and (source not in ("megatron_lite", "peft") or target == "peft"):
        raise ConfigError("--merge-lora reads LoRA adapters (a megatron_lite LoRA checkpoint, or --source-format peft) "
                          "and writes the merged model: --target-format megatron_lite, hf or megatron.")
    if target == "peft" and source in ("hf", "megatron"):
        raise ConfigError(f"--target-format peft writes LoRA adapters, and a {source} checkpoint holds a whole model "
                          f"without any: fine-tune it with --peft lora, then export the adapters.")
    if source == "peft" and target in ("hf", "megatron") and not args.merge_lora:
        raise ConfigError(f"--source-format peft holds adapters, and a {target} checkpoint holds a whole model: add "
                          f"--merge-lora to write the base with the adapters merged in.")
    if args.fold_prefix_projection and (source, target) != ("megatron_lite", "megatron_lite"):
        raise ConfigError("--fold-prefix-projection rewrites a megatron_lite prefix-tuning checkpoint as one.")
    if args.target_expert_parallel_size != 1 and target != "megatron":
        raise ConfigError("--target-expert-parallel-size splits the experts of a Megatron-LM export (--target-format "
                          "megatron); a megatron_lite checkpoint loads at any --expert-model-parallel-size as it is.")
    if args.megatron_common_state and (target, args.megatron_ckpt_format) != ("megatron", "torch_dist"):
        raise ConfigError("--megatron-common-state lays out a torch_dist export: give it with --target-format "
                          "megatron --megatron-ckpt-format torch_dist, or drop it.")
    if source == "peft" and not args.base_checkpoint:
        raise ConfigError("--source-format peft needs --base-checkpoint: the megatron_lite checkpoint of the "
                          "base model (import it with --source-format hf first).")
    if source == "megatron_lite":
        return _export(args, args.load_dir, sizes)
    if target == "megatron_lite" and not args.merge_lora:
        return _import(args, args.save_dir, sizes)
    # Two steps: the import is written at one process (the export reshards anyway), and removed afterwards.
    with _scratch_beside(args.save_dir) as scratch:
        return _export(args, _import(args, scratch, {}), sizes)


@contextlib.contextmanager
def _scratch_beside(save_dir: str):
    """A directory for an intermediate megatron_lite checkpoint next to ``save_dir`` (so that it lies on the same
    file system), removed afterwards."""
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".checkpoint_convert-", dir=parent) as scratch:
        yield scratch


def _import(args, save_dir: str, sizes: dict) -> str:
    """--load-dir (hf, megatron or peft) as a megatron_lite checkpoint in ``save_dir``."""
    if args.source_format == "hf":
        return hf_checkpoint.import_hf_checkpoint(args.load_dir, save_dir, **sizes)
    if args.source_format == "megatron":
        return import_megatron_checkpoint(args.load_dir, save_dir, **sizes)
    return hf_peft.import_peft_adapters(args.load_dir, save_dir, base_checkpoint=args.base_checkpoint, **sizes)


def _export(args, load_dir: str, sizes: dict) -> str:
    """The megatron_lite checkpoint ``load_dir`` written as --target-format (its adapters merged, or its
    prefixes folded, first when asked)."""
    target = args.target_format
    tokenizer = {k: getattr(args, k) for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")}
    if args.fold_prefix_projection:
        config, read, training_state = folded_prefix(resolve_checkpoint_dir(load_dir))
        config = dataclasses.replace(config, parallel=ParallelConfig(**sizes))
        return write_checkpoint(args.save_dir, config, read, iteration=0, training_state=training_state)
    if args.merge_lora:
        config, read = merged_lora(resolve_checkpoint_dir(load_dir))
        if target == "hf":
            hf_checkpoint.export_hf_weights(config, read, args.save_dir, tokenizer_flags=tokenizer,
                                         hf_model_type=args.hf_model_type)
            return args.save_dir
        if target == "megatron":  # the merged model in our format first, which the Megatron-LM export reads
            with _scratch_beside(args.save_dir) as scratch:
                return _export_megatron(args, write_checkpoint(scratch, config, read, iteration=0), sizes)
        return write_checkpoint(args.save_dir, dataclasses.replace(config, parallel=ParallelConfig(**sizes)), read,
                                iteration=0)
    if target == "megatron":
        return _export_megatron(args, load_dir, sizes)
    if target == "peft":
        hf_peft.export_peft_adapters(load_dir, args.save_dir, hf_model_type=args.hf_model_type,
                                     base_model_name_or_path=args.base_model_name_or_path)
        return args.save_dir
    if target == "hf":
        hf_checkpoint.export_hf_checkpoint(load_dir, args.save_dir, tokenizer_flags=tokenizer,
                                        hf_model_type=args.hf_model_type)
        return args.save_dir
    return reshard_checkpoint(load_dir, args.save_dir, **sizes)


def _export_megatron(args, load_dir: str, sizes: dict) -> str:
    return export_megatron_checkpoint(load_dir, args.save_dir, ckpt_format=args.megatron_ckpt_format,
                                      common_state=args.megatron_common_state or "common.pt",
                                      expert_model_parallel_size=args.target_expert_parallel_size, **sizes)


if __name__ == "__main__":
    sys.exit(main())
