"""Training throughput of megatron_lite's GPT vs Hugging Face GPT2LMHeadModel, same shapes, one process.

The two models alternate step by step so both see the same machine state; the
ratio of tokens/s is the number to watch (issue: >= 1.0 on CPU).

    python bench/bench_gpt_vs_hf.py [--steps 6] [--threads 2]
"""
import argparse
import time

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model import GPTModel, initialize_weights
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig

LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH, VOCAB = 6, 512, 8, 256, 8, 8192


def megatron_lite_model():
    config = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                         vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
    state = initialize_model_parallel(1, 1)
    model = GPTModel(config, TensorParallelConfig(state.tensor_model_parallel_group))
    initialize_weights([model], config, state, seed=1)
    return model, lambda ids, labels: model(ids, labels=labels).mean()


def transformers_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    return model, lambda ids, labels: torch.nn.functional.cross_entropy(
        model(ids).logits.view(-1, VOCAB), labels.reshape(-1))


def step_fn(model, loss_of):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids, labels):
        loss = loss_of(ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    steps = {"megatron_lite": step_fn(*megatron_lite_model()), "transformers": step_fn(*transformers_model())}
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    for step in steps.values():  # warm-up: allocator, first-call dispatch
        step(tokens, labels)
    elapsed = {name: 0.0 for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step(tokens, labels)
            elapsed[name] += time.perf_counter() - start
    tokens_per_step = MICRO_BATCH * SEQ
    rates = {name: args.steps * tokens_per_step / seconds for name, seconds in elapsed.items()}
    print(f"GPT-2 shape: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, micro batch {MICRO_BATCH}, "
          f"vocab {VOCAB}, fp32, {args.threads} threads, {args.steps} steps each (alternating)")
    for name, rate in rates.items():
        print(f"  {name:14s} {rate:10.1f} tokens/s")
    print(f"  ratio megatron_lite / transformers: {rates['megatron_lite'] / rates['transformers']:.3f}")


if __name__ == "__main__":
    main()
