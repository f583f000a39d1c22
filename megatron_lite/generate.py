"""Sample text from a checkpoint in one process, whatever layout trained it.

    python -m megatron_lite.generate --load CKPT --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --prompt "Once upon a time"

The checkpoint's own config gives the architecture; its weights are resharded to
tensor = pipeline = 1 on load.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from megatron_lite.checkpointing import load_checkpoint, read_config
from megatron_lite.config import CheckpointConfig, ParallelConfig
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.inference.text_generation import generate
from megatron_lite.model.builder import build_model
from megatron_lite.tokenizer import build_tokenizer


def load_single_process_model(load_dir: str):
    """(model, config) with the checkpoint's weights, on one process."""
    saved = read_config(load_dir)
    config = dataclasses.replace(saved, parallel=ParallelConfig(), checkpoint=CheckpointConfig(load=load_dir))
    parallel_state = initialize_model_parallel(1, 1)
    (model,) = build_model(config, parallel_state)
    load_checkpoint(config, parallel_state, [model], None, None)
    destroy_model_parallel(parallel_state)
    return model, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.generate", allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory (--save of the training run)")
    parser.add_argument("--tokenizer-type", required=True)
    parser.add_argument("--vocab-file")
    parser.add_argument("--merge-file")
    parser.add_argument("--tokenizer-model")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                tokenizer_model=args.tokenizer_model)
    model, config = load_single_process_model(args.load)
    prompt_ids = tokenizer.tokenize(args.prompt) or [tokenizer.eod]
    new_ids = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, vocab_size=config.model.vocab_size,
                       seq_length=config.model.seq_length, temperature=args.temperature, top_k=args.top_k,
                       eod=tokenizer.eod, generator=torch.Generator().manual_seed(args.seed))
    print(f"--- sample ({len(new_ids)} tokens) ---\n{args.prompt}{tokenizer.detokenize(new_ids)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
