"""Generate text from a checkpoint, in one process or under torchrun with tensor, pipeline, expert and data
parallelism.

    # one prompt, sampled; the tokenizer is the one the checkpoint was trained with
    python -m megatron_lite.generate --load CKPT --prompt "Once upon a time"

    # a file of prompts, greedy, 8 per batch, on 4 processes (tp 2 x pp 2)
    torchrun --nproc-per-node 4 -m megatron_lite.generate --load CKPT --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompts-file prompts.jsonl --output-file answers.jsonl --greedy

    # long prompts: their prefill split over 2 context-parallel ranks, each with tensor-parallel size 2
    torchrun --nproc-per-node 4 -m megatron_lite.generate --load CKPT --context-parallel-size 2 \\
        --tensor-model-parallel-size 2 --prompts-file long_prompts.jsonl --greedy

    # a mixture of experts split over 4 processes, which also split the prompts (data-parallel size 4)
    torchrun --nproc-per-node 4 -m megatron_lite.generate --load CKPT --expert-model-parallel-size 4 \\
        --prompts-file prompts.jsonl --output-file answers.jsonl

``--prompts-file`` lines are ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}``
(a conversation ending with a user or system message); ``--output-file`` gets one
``{"prompt": ..., "response": ...}`` line per prompt, in order (``prompt`` is the line's prompt or
messages), the response being the generated text only (up to EOD, without the chat format's
end-of-turn marker). Prompts go through the chat template the checkpoint was fine-tuned with
(``--sft-tokenizer-prompt-format``, recorded in its config; ``plain``, the text as written, for a
pretrained model), exactly as training tokenized them: a ``{"prompt": p}`` is the conversation of
one user message ``p``. The checkpoint's config gives the architecture and its weights are
resharded to the layout asked for; the tokens do not depend on the layout. Processes beyond
tensor x context x pipeline are data-parallel ranks, each generating every d-th batch (``inference/data_parallel.py``);
each batch samples from its own generator, seeded by ``--seed`` and its index, so the responses are those
of one process.
"""
from __future__ import annotations

import json
import sys

import torch

from megatron_lite.config import SFT_PROMPT_FORMATS, ConfigError
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.data.jsonl import read_jsonl_lines
from megatron_lite.data.sft.prompt_format import ROLES, format_prompt, response_text
from megatron_lite.inference.data_parallel import gathered_in_order, share_of_rank
from megatron_lite.inference.loading import (add_layout_arguments, add_tokenizer_arguments, checkpoint_tokenizer,
                                             layout_of, load_model, model_parallel_state, read_checkpoint_config)
from megatron_lite.inference.text_generation import check_sampling, generate
from megatron_lite.process_groups.failures import run_command
from megatron_lite.tokenizer import TOKENIZER_FIELDS


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m megatron_lite.generate", allow_abbrev=False,
                            description="Generate text from a megatron_lite checkpoint.")
    parser.add_argument("--load", required=True, help="checkpoint directory (the --save of a training run)")
    prompts = parser.add_argument_group("prompts and output")
    prompts.add_argument("--prompt", help="one prompt (default: none, the model starts from EOD)")
    prompts.add_argument("--prompts-file", help='JSONL, one {"prompt": "..."} or {"messages": [...]} per line')
    prompts.add_argument("--output-file", help='JSONL, one {"prompt": ..., "response": ...} per prompt '
                                               "(default: print the samples)")
    prompts.add_argument("--micro-batch-size", type=int, default=8, help="prompts generated together (default: 8)")
    prompts.add_argument("--sft-tokenizer-prompt-format", choices=SFT_PROMPT_FORMATS,
                         help="the chat template prompts go through (default: the one the checkpoint was "
                              "fine-tuned with; plain for a pretrained one)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=64,
                          help="tokens generated per prompt at most; EOD ends a sequence early (default: 64)")
    sampling.add_argument("--greedy", action="store_true", help="take the most likely token at every step")
    sampling.add_argument("--temperature", type=float, default=0.8,
                          help="divides the logits before sampling; 0 is --greedy (default: 0.8)")
    sampling.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; 0: all "
                                                                "(default: 40)")
    sampling.add_argument("--top-p", type=float, default=0.0,
                          help="sample among the most likely tokens holding probability p; 0: all (default: 0)")
    sampling.add_argument("--seed", type=int, default=1234,
                          help="seed of the sampling generators, one per batch: --seed + its index (default: 1234)")
    add_layout_arguments(parser)
    add_tokenizer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: generate_from_checkpoint(build_parser().parse_args(argv)))


def generate_from_checkpoint(args) -> None:
    check_sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}.")
    if args.prompt is not None and args.prompts_file is not None:
        raise ConfigError("--prompt and --prompts-file both given: pass one.")
    config = read_checkpoint_config(args.load, layout_of(args))
    tokenizer = checkpoint_tokenizer(config, {name: getattr(args, name) for name in TOKENIZER_FIELDS})
    prompt_format = args.sft_tokenizer_prompt_format or config.data.sft_tokenizer_prompt_format
    prompts = _read_prompts(args.prompts_file) if args.prompts_file else [args.prompt or ""]
    parallel_state = model_parallel_state(config.parallel)
    model = load_model(config, parallel_state)
    batches = (prompts[start:start + args.micro_batch_size] for start in range(0, len(prompts), args.micro_batch_size))
    results = []
    for index, batch in share_of_rank(batches, parallel_state):
        # Each batch's own generator, alike on every model-parallel rank: the tokens do not depend on the layout.
        generator = torch.Generator().manual_seed(args.seed + (index or 0))
        new_tokens = generate(model, [format_prompt(_conversation(p), tokenizer, prompt_format) or [tokenizer.eod]
                                      for p in batch],
                              max_new_tokens=args.max_new_tokens, eod=tokenizer.eod, greedy=args.greedy,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              generator=generator, parallel_state=parallel_state)
        if index is not None:  # not a filler
            results.append((index, [{"prompt": p, "response": response_text(ids, tokenizer, prompt_format)}
                                    for p, ids in zip(batch, new_tokens)]))
    results = gathered_in_order(results, parallel_state)
    if parallel_state.rank == 0:
        _write_results(results, args)


def _read_prompts(path: str) -> list:
    """The prompts of a JSONL file (text, or a list of messages); a bad line is named ``file:line``."""
    try:
        prompts = [_prompt_of(line, f"{path}:{number}") for _, number, line in read_jsonl_lines([path])]
    except OSError as error:
        raise ConfigError(f"--prompts-file {path}: {error.strerror}.") from None
    if not prompts:
        raise ConfigError(f"--prompts-file {path} holds no prompts.")
    return prompts


def _prompt_of(line: str, where: str):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: malformed JSON ({error.msg} at column {error.colno}).") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    messages = record.get("messages") if isinstance(record, dict) else None
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)):
        raise ConfigError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [{{"role": one of '
                          f'{", ".join(ROLES)}, "content": "..."}}, ...]}}, got {line.strip()[:80]}')
    if messages[-1]["role"] == "assistant":
        raise ConfigError(f"{where}: the conversation ends with the assistant's message; a prompt ends with the "
                          f"user's (or system's) message that the response answers.")
    return messages


def _conversation(prompt) -> list[dict]:
    """A text prompt is one user message, as a {"prompt", "response"} example is in training."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _write_results(results: list[dict], args) -> None:
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
        print(f"wrote {len(results)} responses to {args.output_file}", flush=True)
    elif args.prompts_file:
        for result in results:
            print(json.dumps(result, ensure_ascii=False), flush=True)
    else:
        (result,) = results
        print(f"--- sample ---\n{result['prompt']}{result['response']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
