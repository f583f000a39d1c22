"""The core of attention, softmax(QK^T * scale) V over one rank's heads (Megatron-Core's DotProductAttention).

Every attention variant (``attention.py``'s grouped-query attention, ``multi_latent_attention.py``) makes its
queries, keys and values its own way and hands them here, so the masks (causal, a generation's padding, the
sliding window), packed examples (each document in a row of its own, ``document_rows.py``), a prefix's keys
and values (prefix tuning), the soft-capping, the dropout and the backend choice live in one place. Keys and
values may have different widths (multi-latent attention's values are narrower).

The backend is torch's ``scaled_dot_product_attention`` (``--attention-backend`` auto, flash, fused), or
with unfused/local the explicit path Megatron-LM's local DotProductAttention takes: scaled QK^T, the fused
causal masked softmax, dropout, then V.

Under context parallelism a rank holds only its chunks of the sequence, and the core a layer gets
(``build_core_attention``) is the --cp-comm-type variant of ``context_parallel/attention.py`` wrapped around
its own DotProductAttention, with the same interface.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig, context_parallel_attention
from megatron_lite.model.attention_sinks import sink_softmax
from megatron_lite.model.document_rows import DocumentBuckets, PackedDocuments
from megatron_lite.model.sliding_window import layer_window
from megatron_lite.model.soft_capping import soft_capping
from megatron_lite.tensor_parallel.random import get_rng_tracker

# scaled_dot_product_attention takes grouped keys and values (enable_gqa) from PyTorch 2.5.
SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def build_core_attention(config: ModelConfig, *, layer_number: int, softmax_scale: float, heads_per_group: int = 1,
                         context_parallel: ContextParallelConfig | None = None) -> nn.Module:
    """Layer ``layer_number``'s core attention: a DotProductAttention, or under context parallelism the layer's
    --cp-comm-type variant around one. Arguments as DotProductAttention's."""
    core = DotProductAttention(config, layer_number=layer_number, softmax_scale=softmax_scale,
                               heads_per_group=heads_per_group)
    return core if context_parallel is None else context_parallel_attention(core, context_parallel, layer_number)


class DotProductAttention(nn.Module):
    """No parameters; a module so that ``train()``/``eval()`` switch its dropout.

    Args:
        softmax_scale: the scale of QK^T.
        heads_per_group: query heads per key/value head (grouped-query attention), 1 when each head has its own.
    """

    def __init__(self, config: ModelConfig, *, layer_number: int, softmax_scale: float, heads_per_group: int = 1):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.heads_per_group = heads_per_group
        self.attention_dropout = config.attention_dropout
        # Capping acts between QK^T and the softmax, and sinks join the softmax: only the explicit path exposes them.
        self.logit_capping = soft_capping(config.attn_logit_softcapping)
        self.unfused = (config.attention_backend in ("unfused", "local") or self.logit_capping is not None
                        or config.softmax_type != "vanilla")
        self.sliding_window = layer_window(config, layer_number)

    def forward(self, query, key, value, attention_mask=None, prefix=None, softmax_offset=None):
        """[s, b, heads, d] queries and [sk, b, groups, d or dv] keys and values -> [s, b, heads * dv].

        ``attention_mask``: None for causal attention, PackedDocuments for packed examples (sk = s), else bool
        [b, 1, s, sk], True where a query may not attend. ``prefix``: keys and values put before the sequence's
        own, which every query sees (``peft/prefix_tuning.py``'s ``KeyValuePrefix``). ``softmax_offset``: each
        head's sink logit [heads] (``attention_sinks.py``), or None.
        """
        if isinstance(attention_mask, PackedDocuments):
            return self._by_document(query, key, value, attention_mask.buckets(), prefix, softmax_offset)
        if prefix is not None:
            key, value, attention_mask = prefix(key, value, attention_mask)
        seq, batch = query.shape[:2]
        # [s, b, n, d] -> [b, n, s, d]; each key/value group serves heads_per_group query heads.
        query = query.permute(1, 2, 0, 3)
        key, value = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        # SDPA reads each group's keys for its heads itself (enable_gqa); elsewhere they are copied out.
        grouped = {"enable_gqa": True} if self.heads_per_group > 1 and SDPA_HAS_GQA and not self.unfused else {}
        if self.heads_per_group > 1 and not grouped:
            key = key.repeat_interleave(self.heads_per_group, dim=1)
            value = value.repeat_interleave(self.heads_per_group, dim=1)
        dropout = self.attention_dropout if self.training else 0.0
        # Heads differ across tensor-parallel ranks, so their dropout masks must too.
        rng = get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        query_length, key_length = query.shape[2], key.shape[2]
        if attention_mask is not None or self.unfused or self.sliding_window is not None:
            attention_mask = _mask_after_cache(attention_mask, query_length, key_length, query.device)
        if self.sliding_window is not None:
            attention_mask = self.sliding_window.mask(attention_mask, query_length, key_length, query.device)
        with rng:
            if self.unfused:
                context = _unfused_attention(query, key, value, dropout, attention_mask, self.softmax_scale,
                                             self.logit_capping, softmax_offset)
            elif attention_mask is None:
                context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout,
                                                         scale=self.softmax_scale,
                                                         **_causal(query_length, key_length), **grouped)
            else:  # SDPA's boolean mask marks what may be attended
                context = F.scaled_dot_product_attention(query, key, value, attn_mask=~attention_mask,
                                                         dropout_p=dropout, scale=self.softmax_scale, **grouped)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _by_document(self, query, key, value, documents: DocumentBuckets, prefix, softmax_offset):
        """Causal attention within each document's row, then back to the positions: what the block-diagonal mask
        computes, without an [s, s] tensor. Every feature acts as on one unpacked example: the window counts
        positions within the document, and a prefix is seen by every document, before its first token."""
        if not (query.shape[0] == key.shape[0] and documents.shape == (query.shape[1], query.shape[0])):
            raise ValueError(f"packed documents [b, s] = {list(documents.shape)} attend within their own sequence: "
                             f"they need its s queries of each of b rows and as many keys; got queries [s, b] = "
                             f"{list(query.shape[:2])} and {key.shape[0]} keys. Pass a mask for queries after "
                             f"cached keys.")

        def attend(*rows):  # [documents, longest, ...] each, the core's [longest, documents, ...] inside
            return self.forward(*(x.transpose(0, 1) for x in rows), None, prefix, softmax_offset).transpose(0, 1)
        context = documents.apply(attend, query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
        return context.transpose(0, 1)


def _unfused_attention(query, key, value, dropout: float, attention_mask, scale: float, logit_capping=None,
                       softmax_offset=None):
    """softmax(QK^T * scale) V with the probabilities materialised; [b, n, s, d] in, [b, n, s, dv] out.

    As Megatron-LM, the scale (1/sqrt(d) unless --softmax-scale) goes into the QK^T matmul (so fp16
    scores stay in range) and the softmax kernel, which takes [b * n, sq, sk], applies the causal mask;
    an ``attention_mask`` (True = may not attend) replaces it. ``logit_capping`` (soft_capping.py)
    caps the scaled scores before the mask; ``softmax_offset`` puts each head's sink in the softmax.
    """
    batch, heads, sq, d = query.shape
    sk, dv = key.shape[2], value.shape[-1]
    scores = torch.baddbmm(query.new_empty(batch * heads, sq, sk), query.reshape(-1, sq, d),
                           key.reshape(-1, sk, d).transpose(1, 2), beta=0.0, alpha=scale)
    if logit_capping is not None:
        scores = logit_capping(scores)
    if softmax_offset is not None:
        mask = _causal_mask(sq, sk, query.device) if attention_mask is None else attention_mask
        probs = sink_softmax(scores.view(batch, heads, sq, sk), softmax_offset, mask).view(-1, sq, sk)
    elif attention_mask is None:
        probs = kernels.scaled_upper_triang_masked_softmax(scores, 1.0)
    else:
        probs = kernels.scaled_masked_softmax(scores.view(batch, heads, sq, sk), attention_mask, 1.0).view(-1, sq, sk)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.bmm(probs, value.reshape(-1, sk, dv)).view(batch, heads, sq, dv)


def _causal(query_length: int, key_length: int) -> dict:
    """SDPA's arguments for queries that are the last of the keys' positions (after cached or earlier keys).

    The same positions: ``is_causal``. One new token sees every key: no mask at all, so SDPA stays off its
    masked path at every decoding step. Otherwise torch's bottom-right-aligned causal bias, which the CUDA
    kernels apply without materialising a mask; imported here because ``torch.nn.attention.bias`` imports
    torch._dynamo and DTensor, about a second of every command's start-up."""
    if query_length == key_length:
        return {"is_causal": True}
    if query_length == 1:
        return {}
    from torch.nn.attention.bias import causal_lower_right
    return {"attn_mask": causal_lower_right(query_length, key_length)}


def _mask_after_cache(attention_mask, query_length: int, key_length: int, device):
    """The mask (True = may not attend) of queries that follow cached keys (generation) or a prefix: they
    are the last ``query_length`` of ``key_length`` positions, each seeing the keys up to its own, so one
    new token sees them all. A given mask, or no earlier keys (None: causal), is left as it is."""
    if attention_mask is not None or query_length == key_length:
        return attention_mask
    return _causal_mask(query_length, key_length, device)


def _causal_mask(query_length: int, key_length: int, device) -> torch.Tensor:
    """True above the diagonal that ends at the last query and key: queries are the last of the keys' positions."""
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).triu(key_length - query_length + 1)
