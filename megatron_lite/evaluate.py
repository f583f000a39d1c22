"""Evaluate a checkpoint at any layout: perplexity on data, exact match of greedy answers.

    # perplexity over every token of an indexed dataset (consecutive samples of --seq-length + 1 tokens)
    python -m megatron_lite.evaluate --load CKPT --data-path data/corpus_text_document

    # perplexity over the response tokens of fine-tuning data, and exact match of greedy answers
    python -m megatron_lite.evaluate --load CKPT --sft --data-path test.jsonl --exact-match \\
        --output-file answers.jsonl

    # the same on 8 processes: tensor 2 x pipeline 2, the batches split over 2 data-parallel ranks
    torchrun --nproc-per-node 8 -m megatron_lite.evaluate --load CKPT --data-path data/corpus_text_document \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

    # long sequences: each split over 2 context-parallel ranks, as training splits them
    torchrun --nproc-per-node 2 -m megatron_lite.evaluate --load CKPT --data-path data/corpus_text_document \
        --context-parallel-size 2

The checkpoint's own config gives the architecture (any training layout; it is resharded to the one
asked for: tensor, pipeline, context and expert sizes as in training, the processes beyond tensor x context
x pipeline splitting the batches as data-parallel ranks, ``inference/data_parallel.py``) and, unless
``--tokenizer-type`` names another, the tokenizer. Every layout gives one process's numbers. Under context
parallelism the perplexity runs the trainer's model on each rank's load-balanced chunks of every sequence
(``context_parallel/sharding.py``), the losses summed over the ranks; the greedy answers are generation's,
their prompts' prefill split over the ranks (``inference/text_generation.py``), on the model loaded a second
time to run whole sequences (the first is freed before). Fine-tuning data is read as
in training (the checkpoint's ``--sft-tokenizer-prompt-format`` unless given, one example per sample,
truncated to --seq-length + 1 tokens); the answer to each JSONL line is generated greedily, with the
key/value cache, from its conversation without the last (assistant) message and compared with that
message, whitespace at the ends ignored. ``--output-file`` gets one JSON line per example.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys

import numpy as np
import torch

from megatron_lite.config import SFT_PROMPT_FORMATS, ConfigError
from megatron_lite.context_parallel import get_batch_on_this_cp_rank
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.data import IndexedDataset
from megatron_lite.data.data_samplers import collate_gpt_batch
from megatron_lite.data.sft import format_prompt, load_sft_examples, response_text, split_last_response
from megatron_lite.data.sft.examples import read_conversations
from megatron_lite.data.sft.formats import RecordFormat, add_record_format_arguments
from megatron_lite.data.sft.sft_dataset import build_sample
from megatron_lite.inference.data_parallel import gathered_in_order, share_of_rank
from megatron_lite.inference.forward import forward_through_stages
from megatron_lite.inference.loading import (add_layout_arguments, add_tokenizer_arguments, checkpoint_tokenizer,
                                             layout_of, load_model, model_parallel_state, read_checkpoint_config)
from megatron_lite.inference.text_generation import generate
from megatron_lite.process_groups.failures import run_command
from megatron_lite.process_groups import collectives
from megatron_lite.process_groups.initialize import resolve_launch_env
from megatron_lite.process_groups.parallel_state import destroy_model_parallel
from megatron_lite.tokenizer import TOKENIZER_FIELDS
from megatron_lite.training.loop import loss_func


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m megatron_lite.evaluate", allow_abbrev=False,
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint directory (--save of the training run)")
    parser.add_argument("--data-path", required=True, nargs="+",
                        help="indexed dataset prefix(es); with --sft, JSONL file(s) or preprocessed --sft prefixes")
    parser.add_argument("--sft", action="store_true", help="fine-tuning data: the loss covers response tokens only")
    parser.add_argument("--sft-tokenizer-prompt-format", choices=SFT_PROMPT_FORMATS,
                        help="with --sft: the chat template (default: the one the checkpoint was fine-tuned with)")
    add_record_format_arguments(parser)  # --sft-format, --sft-data-keys: the data read as in training
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward for perplexity")
    parser.add_argument("--max-samples", type=int, help="stop the perplexity after this many samples")
    parser.add_argument("--exact-match", action="store_true",
                        help="with --sft JSONL: generate each answer greedily and compare it with the response")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output-file", help="--exact-match: one JSON line per example")
    add_layout_arguments(parser)
    add_tokenizer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: print_evaluation(build_parser().parse_args(argv)))


def print_evaluation(args: argparse.Namespace) -> None:
    results = evaluate_checkpoint(args)
    if resolve_launch_env().rank == 0:
        print("\n".join(format_results(results)), flush=True)


def evaluate_checkpoint(args: argparse.Namespace) -> dict:
    """{"lm loss", "ppl", "tokens"} and, with --exact-match, {"exact match", "examples"}."""
    if args.exact_match and not args.sft:
        raise ConfigError("--exact-match compares answers with the responses of fine-tuning data: add --sft.")
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}.")
    if not args.sft and (args.sft_format != "auto" or args.sft_data_keys):
        raise ConfigError("--sft-format and --sft-data-keys say how to read fine-tuning data: add --sft.")
    record_format = RecordFormat.from_flags(args.sft_format, args.sft_data_keys)
    config = read_checkpoint_config(args.load, layout_of(args))
    tokenizer = checkpoint_tokenizer(config, {name: getattr(args, name) for name in TOKENIZER_FIELDS})
    prompt_format = args.sft_tokenizer_prompt_format or config.data.sft_tokenizer_prompt_format
    parallel_state = model_parallel_state(config.parallel)
    try:
        return _evaluate(config, tokenizer, prompt_format, record_format, args, parallel_state)
    finally:
        destroy_model_parallel(parallel_state)


def _evaluate(config, tokenizer, prompt_format: str, record_format: RecordFormat, args, parallel_state) -> dict:
    seq_length = config.model.seq_length
    if args.sft:
        examples = load_sft_examples(args.data_path, tokenizer, prompt_format, record_format)
        samples = (build_sample([examples.get(i)], seq_length=seq_length, pad_token=tokenizer.pad,
                                pack_sequences=False) for i in range(len(examples)))
        collate = torch.utils.data.default_collate
    else:
        samples = ({"tokens": window} for window in _consecutive_windows(args.data_path, seq_length))
        collate = functools.partial(collate_gpt_batch, eod_token=None, eod_mask_loss=False)
    model = load_model(config, parallel_state, split_sequences=True)  # whole sequences at context-parallel size 1
    loss_sum, num_tokens = _loss_sum_and_count(model, samples, collate, args.micro_batch_size, args.max_samples,
                                               parallel_state)
    lm_loss = loss_sum / max(num_tokens, 1)
    results = {"lm loss": lm_loss, "ppl": math.exp(min(20.0, lm_loss)), "tokens": num_tokens}
    if args.exact_match:
        if parallel_state.context_parallel_world_size > 1:  # decoding runs whole sequences on every rank
            del model
            model = load_model(config, parallel_state)
        results.update(_exact_match(model, tokenizer, prompt_format, record_format, args, parallel_state))
    return results


def format_results(results: dict) -> list[str]:
    lines = [f" evaluation | lm loss value: {results['lm loss']:.6E} | lm loss PPL: {results['ppl']:.6E} | "
             f"loss tokens: {results['tokens']} |"]
    if "exact match" in results:
        lines.append(f" exact match: {results['exact match']:.4f} ({results['matches']} of {results['examples']})")
    return lines


def _consecutive_windows(prefixes: list[str], seq_length: int):
    """seq_length + 1 tokens at a time through each dataset's documents in order; consecutive windows share
    their boundary token, as GPT samples do, so every token but the first is predicted once."""
    for prefix in prefixes:
        dataset, window = IndexedDataset(prefix), np.empty(0, dtype=np.int64)
        for index in range(len(dataset)):
            window = np.concatenate([window, dataset[index]])
            while len(window) >= seq_length + 1:
                yield window[:seq_length + 1]
                window = window[seq_length:]


@torch.no_grad()
def _loss_sum_and_count(model, samples, collate, micro_batch_size: int, max_samples: int | None, parallel_state):
    """(sum of the loss-masked token losses, their number) over ``samples``, batched by ``collate``: each
    data-parallel rank sums its batches on the last stage (each context-parallel rank its chunks of them, as
    training cuts a micro-batch), and the sums are added over the stages (only the last one's are not zero),
    the context-parallel and the data-parallel ranks."""
    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # float64: a sum over millions of tokens
    samples = itertools.islice(samples, max_samples)
    batches = iter(lambda: list(itertools.islice(samples, micro_batch_size)), [])
    for index, batch in share_of_rank(batches, parallel_state):
        batch = get_batch_on_this_cp_rank({key: value.to(device) for key, value in collate(batch).items()},
                                          parallel_state.context_parallel_rank,
                                          parallel_state.context_parallel_world_size)
        output = forward_through_stages(model, parallel_state, batch["tokens"], batch["position_ids"],
                                        labels=batch["labels"])
        if output is not None and index is not None:  # the last stage, and no filler
            batch_sum, batch_tokens, _ = loss_func(batch["loss_mask"], output)
            totals += torch.stack([batch_sum.double(), batch_tokens.double()])
    for group in (parallel_state.pipeline_model_parallel_group, parallel_state.data_parallel_group_with_context):
        collectives.all_reduce(totals, group)
    return totals[0].item(), int(totals[1].item())


def _exact_match(model, tokenizer, prompt_format: str, record_format: RecordFormat, args, parallel_state) -> dict:
    """Each data-parallel rank answers its share of the examples; rank 0 counts and writes them in order."""
    examples = ((f"{path}:{line_number}", *split_last_response(messages)) for path in args.data_path
                for line_number, messages in read_conversations(path, record_format))
    answered = []
    for index, (source, prompt, reference) in share_of_rank(examples, parallel_state):
        prompt_ids = format_prompt(prompt, tokenizer, prompt_format) or [tokenizer.eod]
        answer_ids = generate(model, [prompt_ids], max_new_tokens=args.max_new_tokens, eod=tokenizer.eod,
                              greedy=True, parallel_state=parallel_state)[0]
        if index is not None:  # not a filler
            answer = response_text(answer_ids, tokenizer, prompt_format)
            answered.append((index, [{"source": source, "messages": prompt, "reference": reference,
                                      "response": answer, "exact_match": answer.strip() == reference.strip()}]))
    records = gathered_in_order(answered, parallel_state)
    if args.output_file and parallel_state.rank == 0:
        with open(args.output_file, "w", encoding="utf-8") as output:
            output.writelines(json.dumps(record) + "\n" for record in records)
    matches = sum(record["exact_match"] for record in records)
    return {"exact match": matches / max(len(records), 1), "matches": matches, "examples": len(records)}


if __name__ == "__main__":
    sys.exit(main())
