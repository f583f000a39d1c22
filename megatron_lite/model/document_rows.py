"""The documents of a batch as rows of their own: packed examples (--sft-pack-sequences) kept apart without an
[s, s] mask, and a fresh start at each document for layers that carry a state along the sequence (the gated
DeltaNet's convolution and scan).

A packed micro-batch carries each position's document (``document_ids`` [b, s]), which the model is handed as
``PackedDocuments`` where an unpacked one has no mask (Megatron-LM's PackedSeqParams, with per-token ids rather
than cu_seqlens: they collate and cut like the tokens). Each document is moved to a row of its own ([documents,
longest document, ...], zero after a short one's end), the layer runs on the rows as on a batch (attention with
its plain causal kernel, flash on CUDA), and the outputs go back to their positions: a query sees exactly its
document's earlier keys, as under the block-diagonal mask, and a row's padding comes after every real token.
In training the documents are grouped by length first (``DocumentBuckets``: lengths in (2^(k-1), 2^k], one call
per group), so the rows hold at most twice the tokens: one row per document as long as the longest would hold
documents x longest (40 short examples beside one of 16k positions: 40 x 16k) and attend over all of it.

Generation's left padding is still a mask; where a document starts is then read off it (``document_starts``):
a token that may not see the token before it starts one (each padding token a one-token document, the prompt's
first token the start of its own). A recurrence there keeps one row per document (``DocumentRows``), whose
state enters and leaves with each batch row.
"""
from __future__ import annotations

import torch

from megatron_lite.context_parallel import ContextParallelConfig, local_positions


class PackedDocuments:
    """What the layers read of a packed micro-batch in place of a mask: ``document_ids`` [b, s], each position's
    document in its row (a document's positions contiguous; padding is a document of its own). The rows (or a
    mask) are built once, at the first layer that asks, and shared by the others."""

    def __init__(self, document_ids: torch.Tensor):
        self.document_ids = document_ids
        self._buckets = self._mask = None

    def starts(self) -> torch.Tensor:
        """bool [b, s]: True where a token starts a document."""
        starts = torch.ones_like(self.document_ids, dtype=torch.bool)
        starts[:, 1:] = self.document_ids[:, 1:] != self.document_ids[:, :-1]
        return starts

    def buckets(self) -> DocumentBuckets:
        """The documents in rows, grouped by length."""
        if self._buckets is None:
            self._buckets = DocumentBuckets(self.starts())
        return self._buckets

    def mask(self, context_parallel: ContextParallelConfig | None = None) -> torch.Tensor:
        """The block-diagonal causal mask, bool [b, 1, s, s] (True = may not attend), or under context parallelism
        this rank's query rows of it, [b, 1, s/cp, s]: for the cores that cut blocks out of a mask (context
        parallelism's), built where they attend (once: every layer asks with the same ``context_parallel``), never
        in the data path."""
        if self._mask is None:
            seq, device = self.document_ids.shape[1], self.document_ids.device
            queries = (torch.arange(seq) if context_parallel is None else
                       local_positions(seq, context_parallel.rank, context_parallel.size)).to(device)
            later = torch.arange(seq, device=device) > queries[:, None]
            other = self.document_ids[:, queries, None] != self.document_ids[:, None, :]
            self._mask = (later | other)[:, None]
        return self._mask


def core_attention_input(attention_mask, context_parallel: ContextParallelConfig | None, *, chunked: bool = False):
    """``attention_mask`` as a layer hands it to its core: packed documents stay documents (the core attends in
    their rows), except under context parallelism, whose cores cut blocks out of a mask (this rank's rows), and
    in chunked attention (Llama 4), which needs none: its chunks count from each document's first position (the
    position ids restart there), so no chunk crosses a document."""
    if not isinstance(attention_mask, PackedDocuments):
        return attention_mask
    if chunked:
        return None
    return attention_mask if context_parallel is None else attention_mask.mask(context_parallel)


def attention_input(batch: dict):
    """What a micro-batch hands attention: its packed documents, else its mask, else None (causal)."""
    if "document_ids" in batch:
        return PackedDocuments(batch["document_ids"])
    return batch.get("attention_mask")


def document_buckets(attention_mask: torch.Tensor | PackedDocuments | None, seq: int, batch: int,
                     device) -> DocumentBuckets:
    """The documents ``attention_mask`` gives, in rows grouped by length: a packed batch's own (built once for every
    layer), else those ``document_starts`` reads off a mask (none: one document per batch row)."""
    if isinstance(attention_mask, PackedDocuments):
        return attention_mask.buckets()
    return DocumentBuckets(document_starts(attention_mask, seq, batch, continues=False, device=device))


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


class DocumentBuckets:
    """The documents ``starts`` [b, s] marks, grouped by length (1, 2, 3-4, 5-8, ...) and each group moved to rows of
    its own (``DocumentRows`` over the group's tokens, in order): ``apply(function, *tensors)`` runs ``function``
    on each group's rows and puts the outputs back at their positions."""

    def __init__(self, starts: torch.Tensor):
        self.shape = tuple(starts.shape)
        self.rows_are_batch = not bool(starts[:, 1:].any())
        if self.rows_are_batch:
            return
        boundaries = starts.clone()
        boundaries[:, 0] = True  # each batch row's first token starts a document
        boundaries = boundaries.flatten()
        document = boundaries.cumsum(0) - 1
        bucket = torch.bincount(document).float().log2().ceil().long()[document]  # each token's document's group
        self.groups = []
        for number in torch.unique(bucket).tolist():
            tokens = (bucket == number).nonzero().squeeze(1)
            self.groups.append((tokens, DocumentRows(boundaries[tokens][None])))
        order = torch.cat([tokens for tokens, _ in self.groups])
        self.inverse = torch.empty_like(order)
        self.inverse[order] = torch.arange(len(order), device=order.device)

    def apply(self, function, *tensors: torch.Tensor) -> torch.Tensor:
        """``function`` of [rows, longest, ...] tensors -> [rows, longest, ...], over [b, s, ...] ``tensors``."""
        if self.rows_are_batch:
            return function(*tensors)
        flat = [tensor.reshape(-1, *tensor.shape[2:]) for tensor in tensors]
        outputs = [rows.from_rows(function(*(rows.to_rows(tensor[tokens][None]) for tensor in flat)))[0]
                   for tokens, rows in self.groups]
        output = torch.cat(outputs)[self.inverse]
        return output.view(*self.shape, *output.shape[1:])
