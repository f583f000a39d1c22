"""Soft-capping (Gemma 2): ``cap * tanh(x / cap)`` bounds scores and logits to (-cap, cap) smoothly, so
no single attention score or output logit can grow without limit, yet small ones pass almost unchanged.

Elementwise, so it applies to any shard of the scores (a tensor-parallel rank's heads) or of the logits
(its slice of the vocabulary) alike. The attention scores are capped before the mask, as transformers
does, so a masked position stays masked.
"""
import torch


class SoftCapping:
    def __init__(self, cap: float):
        self.cap = cap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / self.cap) * self.cap


def soft_capping(cap: float | None):
    """The capping ``cap`` asks for, or None (no capping)."""
    return None if cap is None else SoftCapping(cap)
