"""Generation with the key/value cache against transformers' ``generate``, same weights, same tokens.

A random GPT-2-shaped (or, with ``--model llama``, Llama-shaped) model is built with transformers,
saved, and imported into megatron_lite (``interop/hf/checkpoint``), so both generate from the
same weights: the 51M shape is 8 layers x 512 with GPT-2's 50,257-token vocabulary, the 124M one
GPT-2 small (12 x 768). Both decode greedily for exactly ``--new-tokens`` tokens (no EOS) after random
prompts of ``--prompt-length`` tokens; the tokens must be identical (the run stops if not). Each side
runs in a process of its own and the two alternate round by round (``side_by_side``); the ratio is
transformers' time over ours (> 1 = we are faster).

    python bench/bench_generation.py [--models 51M 124M] [--batch-sizes 1 8 32] [--new-tokens 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile

import torch

# Run as a script, bench/ is on the path but the repository root is not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.side_by_side import Contender, Ratio, alternate, load_average, markdown_table  # noqa: E402

# name -> (layers, hidden, heads); both with GPT-2's vocabulary.
SHAPES = {"51M": (8, 512, 8), "124M": (12, 768, 12)}
VOCAB = 50257


def save_hf_model(directory: str, shape: str, positions: int, family: str = "gpt2") -> int:
    """A random transformers model of ``shape`` saved in ``directory``/hf and imported into ``directory``/ckpt;
    returns its parameter count."""
    import transformers

    from megatron_lite.interop.hf import checkpoint as hf_checkpoint

    layers, hidden, heads = SHAPES[shape]
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
            bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=positions, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(os.path.join(directory, "hf"))
    hf_checkpoint.import_hf_checkpoint(os.path.join(directory, "hf"), os.path.join(directory, "ckpt"))
    return sum(p.numel() for p in model.parameters())


def our_generate(directory: str):
    """(generate(prompts, new_tokens) -> new token ids, None) of megatron_lite on the imported checkpoint."""
    from megatron_lite.config import ParallelConfig
    from megatron_lite.inference.loading import load_model, read_checkpoint_config
    from megatron_lite.inference.text_generation import generate
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel

    config = read_checkpoint_config(os.path.join(directory, "ckpt"), ParallelConfig())
    with contextlib.redirect_stdout(io.StringIO()):  # its "loaded checkpoint" line is not the benchmark's output
        model = load_model(config, initialize_model_parallel(1, 1))
    return (lambda prompts, new_tokens: generate(model, prompts.tolist(), max_new_tokens=new_tokens, greedy=True)), None


def peer_generate(directory: str):
    """(generate(prompts, new_tokens) -> new token ids, None) of transformers' ``generate``, greedy."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(directory, "hf"),
                                                              attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # always exactly new_tokens
    model.generation_config.pad_token_id = 0

    def run(prompts, new_tokens):
        with torch.inference_mode():
            output = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=new_tokens)
        return output[:, prompts.shape[1]:].tolist()
    return run, None


def compare(shape: str, batch_sizes: list, *, prompt_length: int, new_tokens: int, rounds: int, threads: int,
            family: str = "gpt2") -> list:
    """One row per batch size: the per-round ratio of transformers' time to ours, tokens checked equal."""
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        parameters = save_hf_model(directory, shape, prompt_length + new_tokens, family)
        with Contender(our_generate, directory, threads=threads) as ours, \
                Contender(peer_generate, directory, threads=threads) as peer:
            for batch_size in batch_sizes:
                prompts = torch.randint(0, VOCAB, (batch_size, prompt_length),
                                        generator=torch.Generator().manual_seed(batch_size))
                seconds, tokens = alternate({"ours": ours, "peer": peer}, rounds, prompts, new_tokens)
                if tokens["ours"] != tokens["peer"]:
                    raise SystemExit(f"{shape} batch {batch_size}: megatron_lite's tokens differ from transformers'")
                rate = {name: batch_size * new_tokens / statistics.median(t.wall for t in times)
                        for name, times in seconds.items()}
                rows.append({"model": f"{shape} ({parameters / 1e6:.0f}M parameters)", "batch": batch_size,
                             "ratio": Ratio.of(seconds["ours"], seconds["peer"]),
                             "cpu_ratio": Ratio.of(seconds["ours"], seconds["peer"], clock="cpu"),
                             "ours_rate": rate["ours"], "peer_rate": rate["peer"]})
    return rows


def table(rows: list) -> str:
    return markdown_table(
        ["model", "batch", "ours vs transformers (wall), min / median / max", "by CPU time", "tokens/s, ours / peer",
         "tokens"],
        [[r["model"], r["batch"], r["ratio"], r["cpu_ratio"], f"{r['ours_rate']:.0f} / {r['peer_rate']:.0f}",
          "identical"] for r in rows])


def header(prompt_length: int, new_tokens: int, threads: int, rounds: int) -> str:
    return (f"Generation: GPT-2-shaped models, vocab {VOCAB}, fp32, {threads} threads, greedy with the key/value "
            f"cache; prompt {prompt_length} tokens, {new_tokens} new tokens; {rounds} alternating rounds")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(header(args.prompt_length, args.new_tokens, args.threads, args.rounds), flush=True)
    rows = [row for shape in args.models for row in compare(
        shape, args.batch_sizes, prompt_length=args.prompt_length, new_tokens=args.new_tokens, rounds=args.rounds,
        threads=args.threads, family=args.family)]
    print(table(rows))
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
