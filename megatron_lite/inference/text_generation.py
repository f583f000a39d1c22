"""Sampling text from a trained GPT, one process.

No key/value cache: each new token reruns the (short) context, which keeps this
file small; it is for demos and checks, not serving.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, token_ids: list[int], *, max_new_tokens: int, vocab_size: int, seq_length: int,
             temperature: float = 0.8, top_k: int | None = 40, eod: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """Continue ``token_ids``; ``vocab_size`` is the unpadded size, so padding ids are never sampled."""
    model.eval()
    device = next(model.parameters()).device
    tokens = list(token_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-seq_length:]], device=device)
        logits = model(context)[0, -1, :vocab_size].float()
        next_token = _sample(logits, temperature, top_k, generator)
        tokens.append(next_token)
        if next_token == eod:
            break
    return tokens[len(token_ids):]


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k and top_k < logits.numel():  # as Megatron, --top-k 0 samples from the whole vocabulary
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
