"""Generation throughput with the key/value cache vs transformers' ``generate``, same model, one process.

A random GPT-2-shaped (or, with ``--model llama``, Llama-shaped) model is built with
transformers, saved, and imported into megatron_lite (``checkpointing/hf_interop``), so both
generate from the same weights.
Both decode greedily for exactly ``--new-tokens`` tokens (no EOS) after a random prompt
of ``--prompt-length`` tokens; runs alternate between the two so both see the same
machine state, and the best of ``--repeats`` counts. The ratio of tokens/s is the
number to watch (goal: >= 1.0). The generated tokens are checked to be the same.

On CPU, transformers' GPT-2 keeps its weights as [in, out] (``Conv1D``), ours and Llama's
``nn.Linear`` as [out, in]; MKL multiplies a few rows by a transposed weight up to 2x more
slowly, which shows at batch 8 on the wider GPT-2 shapes (``--model llama`` has no such gap).

    python bench/bench_generation.py [--model gpt2|llama] [--layers 8 --hidden 512 --heads 8 --vocab 50257]
        [--batch-sizes 1 8] [--new-tokens 64] [--threads 2]
"""
import argparse
import tempfile
import time

import torch

from megatron_lite.checkpointing import hf_interop
from megatron_lite.config import ParallelConfig
from megatron_lite.inference.loading import load_model, read_checkpoint_config
from megatron_lite.inference.text_generation import generate
from megatron_lite.process_groups.parallel_state import initialize_model_parallel


def build_models(args):
    """(transformers' GPT2LMHeadModel or LlamaForCausalLM, ours imported from it), fp32, eval mode."""
    import transformers

    positions = args.prompt_length + args.new_tokens
    if args.model == "gpt2":
        hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=args.vocab, n_positions=positions, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")).eval()
    else:
        hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=positions,
            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")).eval()
    hf_model.generation_config.eos_token_id = None  # always generate exactly --new-tokens
    hf_model.generation_config.pad_token_id = 0
    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(f"{directory}/hf")
        hf_interop.import_hf_checkpoint(f"{directory}/hf", f"{directory}/ckpt")
        checkpoint_config = read_checkpoint_config(f"{directory}/ckpt", ParallelConfig())
        model = load_model(checkpoint_config, initialize_model_parallel(1, 1))
    return hf_model, model


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf_model, model = build_models(args)
    parameters = sum(p.numel() for p in hf_model.parameters())
    print(f"{args.model} shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
          f"({parameters / 1e6:.1f}M parameters), fp32, CPU, {args.threads} threads; prompt {args.prompt_length} "
          f"tokens, {args.new_tokens} new tokens, greedy, best of {args.repeats}")
    for batch_size in args.batch_sizes:
        prompts = torch.randint(0, args.vocab, (batch_size, args.prompt_length))
        runs = {
            "megatron_lite": lambda: generate(model, prompts.tolist(), max_new_tokens=args.new_tokens, greedy=True),
            "transformers": lambda: hf_model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                max_new_tokens=args.new_tokens)[:, args.prompt_length:].tolist(),
        }
        best, tokens = {name: float("inf") for name in runs}, {}
        with torch.inference_mode():
            for name, run in runs.items():  # warm-up: allocator, first-call dispatch
                run()
            for _ in range(args.repeats):
                for name, run in runs.items():
                    seconds, tokens[name] = timed(run)
                    best[name] = min(best[name], seconds)
        rates = {name: batch_size * args.new_tokens / seconds for name, seconds in best.items()}
        same = "same tokens" if tokens["megatron_lite"] == tokens["transformers"] else "TOKENS DIFFER"
        print(f" batch {batch_size}: " + " | ".join(f"{name} {rate:8.1f} tokens/s" for name, rate in rates.items())
              + f" | ratio megatron_lite / transformers: {rates['megatron_lite'] / rates['transformers']:.3f}"
              + f" | {same}", flush=True)


if __name__ == "__main__":
    main()
