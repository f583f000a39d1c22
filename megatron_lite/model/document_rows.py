"""The documents of a batch as rows of their own, for layers that carry a state along the sequence (the gated
DeltaNet's convolution and scan), which must start afresh at each packed document.

Attention keeps documents apart with its mask; a recurrence has no mask to read, so each document is moved
to a row of its own ([documents, longest document, ...], zero after a short one's end), the layer runs on the
rows as on a batch, and the outputs go back to their positions. Where a document starts is read off the
attention mask the model is given (``document_starts``): a token that may not see the token before it starts
one, which marks --sft-pack-sequences' examples and, in generation, the left padding (each padding token a
one-token document, the prompt's first token the start of its own).
"""
from __future__ import annotations

import torch


def document_starts(attention_mask: torch.Tensor | None, seq: int, batch: int, *, continues: bool,
                    device) -> torch.Tensor:
    """bool [batch, seq]: True where a token starts a document. ``attention_mask``: bool [b or 1, 1, seq, keys],
    True where a query may not attend (keys: the cached ones, then these ``seq``), or None (causal: one document
    per row). ``continues``: the tokens follow cached ones (generation), which a first token sees unless the mask
    says otherwise."""
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    if attention_mask is None:
        starts[:, 0] = not continues
        return starts
    keys = attention_mask.shape[-1]
    previous = torch.arange(seq, device=device) + keys - seq - 1  # each token's predecessor, as a key column
    seen = attention_mask[:, 0, torch.arange(seq, device=device), previous.clamp(min=0)]
    starts = starts | seen.expand(batch, seq)
    starts[:, 0] |= previous[0] < 0
    return starts


class DocumentRows:
    """Moves [b, s, ...] tensors to one row per document and back, for the documents ``starts`` [b, s] marks
    (each batch row's first token starts one, whatever ``starts`` says there)."""

    def __init__(self, starts: torch.Tensor):
        batch, seq = starts.shape
        self.shape = (batch, seq)
        self.rows_are_batch = not bool(starts[:, 1:].any())  # one document per batch row: nothing to move
        self.continues = ~starts[:, 0]  # each batch row's first document goes on from a cached state
        boundaries = starts.clone()
        boundaries[:, 0] = True
        flat = boundaries.flatten()
        self.document = flat.cumsum(0) - 1  # of each token, in order
        first = flat.nonzero().squeeze(1)
        self.position = torch.arange(flat.numel(), device=flat.device) - first[self.document]
        self.lengths = torch.bincount(self.document, minlength=len(first))
        self.num_rows, self.longest = len(first), int(self.lengths.max())
        # Each batch row's first and last document: where a cached state enters, and where the next one leaves.
        self.first_of_row = self.document.view(batch, seq)[:, 0]
        self.last_of_row = self.document.view(batch, seq)[:, -1]

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> [documents, longest, ...], zeros after each document's end."""
        if self.rows_are_batch:
            return x
        rows = x.new_zeros(self.num_rows, self.longest, *x.shape[2:])
        return rows.index_put((self.document, self.position), x.reshape(-1, *x.shape[2:]))

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[documents, longest, ...] -> [b, s, ...]: each token's output from its document's row."""
        if self.rows_are_batch:
            return rows
        return rows[self.document, self.position].view(*self.shape, *rows.shape[2:])

    def valid(self, dtype, device) -> torch.Tensor:
        """[documents, longest]: 1 at a document's tokens, 0 after its end."""
        return self.to_rows(torch.ones(self.shape, dtype=dtype, device=device))
