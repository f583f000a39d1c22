"""Training step time of megatron_lite against transformers (+ peft for LoRA), same shapes, one process.

One whole iteration each: forward, loss, backward, gradient clipping at 1.0 and an AdamW step,
fp32. Ours is the loop's own ``train_step`` (the model, its data-parallel wrapper at size 1, our
optimizer with its clipping); transformers' is its model class called as a training script calls
it, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``. Our model's config is read from
transformers' (``hf_weights.model_config_from_hf``), so the two are the same architecture by
construction: GPT-2 (LayerNorm, learned positions, GELU) and Llama (RMSNorm, RoPE, SwiGLU,
grouped-query attention, untied output layer). LoRA adapts every linear layer of the blocks at rank 8
(ours fuses Q, K and V and SwiGLU's gate and up, so it has fewer, wider adapters).

Each side runs in a process of its own and the steps alternate round by round (``side_by_side``);
the ratio is transformers' time over ours (> 1 = we are faster), min / median / max over rounds.
"Of peak" is the model FLOPs per second of the median step (``model/flops.py``; LoRA computes no
weight gradients of the base, so 2/3 of them) over the best 1024^3 fp32 matmul rate measured in the
same run.

    python bench/bench_training.py [--shapes gpt2 llama] [--lora both|no|only] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# Run as a script, bench/ is on the path but the repository root is not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.side_by_side import Contender, Ratio, alternate, load_average, markdown_table  # noqa: E402

LAYERS, HIDDEN, HEADS, QUERY_GROUPS, SEQ, MICRO_BATCH, VOCAB = 6, 512, 8, 2, 256, 8, 8192
LORA_RANK, LORA_ALPHA = 8, 16
# transformers' names for the linear layers our --lora-target-modules default adapts (all four).
HF_LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
                   "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def hf_config(shape: str):
    import transformers

    if shape == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    num_key_value_heads=QUERY_GROUPS, max_position_embeddings=SEQ,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def batch(seed: int = 0) -> tuple:
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def our_config(shape: str, lora: bool):
    from megatron_lite.interop.hf.weights import model_config_from_hf
    from megatron_lite.config import Config, LoggingConfig, OptimizerConfig, PeftConfig, TrainingConfig

    model = model_config_from_hf(hf_config(shape).to_dict())
    model.hidden_dropout = model.attention_dropout = 0.0
    peft = PeftConfig(peft="lora", lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA) if lora else PeftConfig()
    return Config(model=model, training=TrainingConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH,
                                                       train_iters=10_000),
                  optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0), peft=peft,
                  logging=LoggingConfig(log_memory=False))


def our_step(shape: str, lora: bool):
    """(a no-argument training step of megatron_lite, the model's FLOPs per step)."""
    from megatron_lite.model import flops
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.training.loop import setup_model_and_optimizer, train_step

    config = our_config(shape, lora)
    state = initialize_model_parallel(1, 1)
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, state)
    tokens, labels = batch()
    micro_batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(labels, dtype=torch.float),
                   "position_ids": torch.arange(SEQ).expand_as(tokens)}
    data = itertools.repeat(micro_batch)
    padded_vocab = config.model.padded_vocab_size(1)
    model_flops = flops.num_floating_point_operations(config.model, MICRO_BATCH, padded_vocab) * (2 / 3 if lora else 1)
    return (lambda: train_step(config, state, chunks, optimizer, scheduler, data, 1)[0]), model_flops


def peer_step(shape: str, lora: bool):
    """(a no-argument training step of transformers' model, with peft's LoRA on it with ``lora``; None)."""
    import transformers

    config = hf_config(shape)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA,
                                                           target_modules=HF_LORA_TARGETS[shape]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    tokens, labels = batch()

    def step():
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step, None


def matmul_peak(size: int = 1024, repeats: int = 5) -> float:
    """The best FLOP/s of a size^3 fp32 matmul over ``repeats`` wall-clock timings (the planner's probe)."""
    from megatron_lite.planner.calibrate import matmul_rate

    return max(matmul_rate(torch.float32, size, clock=time.perf_counter) for _ in range(repeats))


def compare(shape: str, lora: bool, rounds: int, threads: int) -> dict:
    """One row: the shape, the per-round ratio, and each side's fraction of the matmul peak."""
    with Contender(our_step, shape, lora, threads=threads) as ours, \
            Contender(peer_step, shape, lora, threads=threads) as peer:
        peak = matmul_peak()
        seconds, _ = alternate({"ours": ours, "peer": peer}, rounds)
        peak = max(peak, matmul_peak())
    model_flops = ours.info
    median = {name: statistics.median(t.wall for t in times) for name, times in seconds.items()}
    name = {"gpt2": "GPT-2", "llama": "Llama"}[shape] + (", LoRA r8" if lora else ", full")
    return {"shape": name, "ratio": Ratio.of(seconds["ours"], seconds["peer"]),
            "cpu_ratio": Ratio.of(seconds["ours"], seconds["peer"], clock="cpu"),
            "ours_s": median["ours"], "peer_s": median["peer"],
            "ours_of_peak": model_flops / median["ours"] / peak, "peer_of_peak": model_flops / median["peer"] / peak,
            "peak_gflops": peak / 1e9}


def table(rows: list) -> str:
    return markdown_table(
        ["shape", "ours vs transformers (wall), min / median / max", "by CPU time", "median step, ours / peer (s)",
         "of the matmul peak, ours / peer"],
        [[r["shape"], r["ratio"], r["cpu_ratio"], f"{r['ours_s']:.2f} / {r['peer_s']:.2f}",
          f"{r['ours_of_peak']:.2f} / {r['peer_of_peak']:.2f}"] for r in rows])


def header(threads: int, rounds: int) -> str:
    return (f"Training: {LAYERS} layers x {HIDDEN} ({HEADS} heads; Llama {QUERY_GROUPS} key/value groups), seq {SEQ}, "
            f"micro-batch {MICRO_BATCH}, vocab {VOCAB}, fp32, {threads} threads, {rounds} alternating rounds; "
            f"forward, backward, clip, AdamW")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=("gpt2", "llama"), default=["gpt2", "llama"])
    parser.add_argument("--lora", choices=("both", "no", "only"), default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = {"both": (False, True), "no": (False,), "only": (True,)}[args.lora]
    print(header(args.threads, args.rounds), flush=True)
    rows = [compare(shape, lora, args.rounds, args.threads) for shape in args.shapes for lora in variants]
    print(table(rows))
    print(f"matmul peak {max(r['peak_gflops'] for r in rows):.0f} GFLOP/s; {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
