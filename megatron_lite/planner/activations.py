"""Activation memory: the tensors a forward pass keeps for its backward, per token.

Korthikanti et al. (2022) count, per transformer layer with 16-bit activations and
1-byte dropout masks, ``s b h (34 + 5 a s / h)`` bytes; ``10 + 24/t`` (+ the s^2 term
over t) under tensor parallelism; everything over t with sequence parallelism; 34/t
with selective recomputation; the layer input alone with full recomputation.

The same count is written out here term by term, so that it also covers what the
paper does not (grouped-query attention, SwiGLU, RMSNorm, rotary embeddings, flash
attention) and follows what *this* code keeps, which differs by device:

- ``CUDA_KERNELS``: our fused kernels (``kernels/fused.py``) keep a norm's input in the
  activation dtype, regenerate dropout masks from a seed instead of storing them, and
  keep SwiGLU's input only; attention is flash (output and log-sum-exp, no s^2 tensors).
- ``CPU_REFERENCE``: the PyTorch reference ops keep an fp32 copy for LayerNorm and two
  for RMSNorm, dropout masks in the activation dtype, SwiGLU's input and its gate; the CPU
  attention is flash only without attention dropout, else the math path (fp32 s^2 tensors).
- ``KORTHIKANTI``: the paper's implementation, for checking the formulas above.

Our sequence-parallel column layers keep the *gathered* input (Megatron keeps the
shard and gathers again in backward): two of the paper's sbh/t terms are sbh here.

Under context parallelism every count is per token *this rank holds* (s/cp of each sequence), and
the attention core keeps what its --cp-comm-type keeps (``_context_parallel_core``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel.sharding import chunk_ids
from megatron_lite.model.chunked_attention import layer_chunks
from megatron_lite.model.flops import keys_per_query


@dataclass(frozen=True)
class KernelTraits:
    """What one implementation keeps for backward; ``None`` bytes mean the activation dtype."""

    layer_norm_bytes: Optional[int]
    rms_norm_bytes: Optional[int]
    hidden_dropout_mask_bytes: Optional[int]  # 0: regenerated in backward
    embedding_dropout_mask_bytes: Optional[int]
    flash_attention: str  # "always", "without_dropout" or "never"
    attention_math_bytes: Optional[int]  # dtype of the unfused path's s^2 tensors
    attention_dropout_mask_bytes: Optional[int]  # its dropout mask (None: attention_math_bytes)
    attention_math_copies_qkv: bool  # the unfused path keeps its own scaled copies of q, k, v
    flash_needs_equal_widths: bool  # flash only when values are as wide as keys (multi-latent attention's are not)
    swiglu_saved_factor: int  # multiples of ffn_hidden_size / t kept by the SwiGLU op
    sequence_parallel_keeps_gathered_input: bool
    # A causal mask aligned to the last keys (queries after earlier keys), per (query, key): CUDA's flash kernels
    # take it as it is (0), the CPU's is materialised as an additive float mask and kept (4).
    lower_right_causal_mask_bytes: int = 0


CUDA_KERNELS = KernelTraits(
    layer_norm_bytes=None, rms_norm_bytes=None, hidden_dropout_mask_bytes=0, embedding_dropout_mask_bytes=1,
    flash_attention="always", attention_math_bytes=None, attention_dropout_mask_bytes=None,
    attention_math_copies_qkv=False, flash_needs_equal_widths=False, swiglu_saved_factor=2,
    sequence_parallel_keeps_gathered_input=True)
CPU_REFERENCE = KernelTraits(
    layer_norm_bytes=4, rms_norm_bytes=8, hidden_dropout_mask_bytes=None, embedding_dropout_mask_bytes=None,
    flash_attention="without_dropout", attention_math_bytes=4, attention_dropout_mask_bytes=None,
    attention_math_copies_qkv=True, flash_needs_equal_widths=True, swiglu_saved_factor=3,
    sequence_parallel_keeps_gathered_input=True, lower_right_causal_mask_bytes=4)
KORTHIKANTI = KernelTraits(
    layer_norm_bytes=None, rms_norm_bytes=None, hidden_dropout_mask_bytes=1, embedding_dropout_mask_bytes=1,
    flash_attention="never", attention_math_bytes=None, attention_dropout_mask_bytes=1,
    attention_math_copies_qkv=False, flash_needs_equal_widths=False, swiglu_saved_factor=2,
    sequence_parallel_keeps_gathered_input=False)
TRAITS = {"cuda": CUDA_KERNELS, "cpu": CPU_REFERENCE}


@dataclass(frozen=True)
class ActivationSetting:
    """Everything besides the model that decides what a layer keeps."""

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    dtype_bytes: int = 2
    selective_recompute: bool = False
    traits: KernelTraits = CUDA_KERNELS
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # this layer's

    def _bytes(self, value: Optional[int]) -> int:
        return self.dtype_bytes if value is None else value

    @property
    def split(self) -> int:
        """Divisor of tensors that sequence parallelism splits (norm inputs, residual masks)."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1

    @property
    def linear_input_split(self) -> int:
        keeps_gathered = self.traits.sequence_parallel_keeps_gathered_input
        return self.tensor_model_parallel_size if self.sequence_parallel and not keeps_gathered else 1


def _uses_flash(model: ModelConfig, setting: ActivationSetting) -> bool:
    mode = setting.traits.flash_attention
    unequal = model.multi_latent_attention and model.qk_head_dim + model.qk_pos_emb_head_dim != model.v_head_dim
    if unequal and setting.traits.flash_needs_equal_widths:
        return False
    return mode == "always" or (mode == "without_dropout" and model.attention_dropout == 0)


def _query_key_value(model: ModelConfig, setting: ActivationSetting) -> float:
    """Elements per token kept of q, k and v (this code's attention.py).

    q, k and v are views of the fused QKV output until rotary embeddings (q, k) or
    the grouped-query expansion to all heads (k, v) copy them; any view left keeps the
    whole QKV output alive. Selective recomputation keeps them as passed to the
    checkpointed core, before the expansion.
    """
    a, g, d, t = model.num_attention_heads, model.num_query_groups, model.head_dim, setting.tensor_model_parallel_size
    rope, grouped = model.position_embedding_type == "rope", g != a
    fused_qkv = (a + 2 * g) * d
    if setting.selective_recompute:
        return (fused_qkv + (a * d + g * d if rope else 0)) / t
    copies = (a * d if rope else 0) + (a * d if rope or grouped else 0) + (a * d if grouped else 0)
    views_left = not rope or not grouped
    return (copies + (fused_qkv if views_left else 0)) / t


def layer_terms(model: ModelConfig, setting: ActivationSetting, layer_number: int = 0,
                expert_tensor_parallel_size: int = 1) -> dict[str, float]:
    """Bytes per token layer ``layer_number`` keeps, by tensor (all divided by ``s * b``)."""
    h, t, e, traits = model.hidden_size, setting.tensor_model_parallel_size, setting.dtype_bytes, setting.traits
    terms = {"norm inputs": 2 * _norm_bytes(model, setting) * h / setting.split,
             "attention and MLP inputs": 2 * e * h / setting.linear_input_split}
    terms.update(_latent_attention_terms(model, setting) if model.multi_latent_attention
                 else _attention_terms(model, setting, layer_number))
    if model.hidden_dropout > 0:
        terms["residual dropout masks"] = 2 * setting._bytes(traits.hidden_dropout_mask_bytes) * h / setting.split
    if model.is_moe_layer(layer_number):
        terms.update(_expert_terms(model, setting, expert_tensor_parallel_size))
        return terms
    f = model.ffn_hidden_size
    terms["MLP activation input"] = e * f * (traits.swiglu_saved_factor if model.swiglu else 1) / t
    terms["MLP fc2 input"] = e * f / t
    return terms


def _expert_terms(model: ModelConfig, setting: ActivationSetting, etp: int) -> dict[str, float]:
    """What a mixture-of-experts layer keeps instead of the MLP's (``moe/``), routing taken as balanced: each
    tensor rank routes its 1/t of the tokens (sequence parallelism's share, or the layer's own split), each
    token k rows, and an expert split over etp ranks sees the rows of all of them."""
    h, t, e, k = model.hidden_size, setting.tensor_model_parallel_size, setting.dtype_bytes, model.moe_router_topk
    f, swiglu = model.moe_ffn_hidden_size, setting.traits.swiglu_saved_factor if model.swiglu else 1
    terms = {"router scores (fp32)": 4 * 3 * model.num_experts / t,  # the logits' softmax, the losses', the map
             "routing indices and weights": (2 * 8 + 4) * k / t,  # permutation, its inverse, the row weights
             "expert inputs": e * k * h * etp / t, "expert activation input": e * k * f * swiglu / t,
             "expert fc2 input": e * k * f / t,
             "expert outputs, and weighted": 2 * e * k * h / t}  # the weighting's input; index_add's source
    if e != 4:
        terms["router input (fp32 copy)"] = 4 * h / t
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None:
        terms["shared expert activation input"] = e * shared * swiglu / t
        terms["shared expert fc2 input"] = e * shared / t
    return terms


def _norm_bytes(model: ModelConfig, setting: ActivationSetting) -> int:
    traits = setting.traits
    return setting._bytes(traits.layer_norm_bytes if model.normalization == "LayerNorm" else traits.rms_norm_bytes)


def _context_parallel(setting: ActivationSetting) -> bool:
    """Whether the core is context-parallel and keeps what its --cp-comm-type keeps (recomputed, it keeps nothing)."""
    return setting.context_parallel_size > 1 and not setting.selective_recompute


def _attention_terms(model: ModelConfig, setting: ActivationSetting, layer_number: int) -> dict[str, float]:
    """``model/attention.py``'s: its queries, keys and values, output and the core's scores (or statistics) over
    the keys of layer ``layer_number``'s queries (a chunked layer's, ``model/chunked_attention.py``)."""
    a, d, t, e = model.num_attention_heads, model.head_dim, setting.tensor_model_parallel_size, setting.dtype_bytes
    terms = {"query, key, value": e * _query_key_value(model, setting), "attention output": e * a * d / t}
    if _context_parallel(setting):
        terms.update(_context_parallel_core(model, setting, layer_number))
        return terms
    terms.update(_core_terms(model, setting, keys_per_query(model, layer_number)))
    if "attention scores" in terms and setting.traits.attention_math_copies_qkv:
        terms["query, key, value"] = setting._bytes(setting.traits.attention_math_bytes) * (3 * a * d) / t
    return terms


def _latent_attention_terms(model: ModelConfig, setting: ActivationSetting) -> dict[str, float]:
    """``model/multi_latent_attention.py``'s: the latents (replicated over tensor-parallel ranks) before and after
    their norms, queries and keys of the heads, the values (views of the up-projection's output, which they keep
    whole: keys and values), the output and the core's scores (or statistics)."""
    a, t, e = model.num_attention_heads, setting.tensor_model_parallel_size, setting.dtype_bytes
    key_width, rotary = model.qk_head_dim + model.qk_pos_emb_head_dim, model.qk_pos_emb_head_dim
    latents = model.kv_lora_rank + (model.q_lora_rank or 0)
    up_projection_inputs = e * latents / setting.linear_input_split
    if model.qk_layernorm:  # the norm keeps its input (the down-projection's output), the up-projection its own
        kept = (_norm_bytes(model, setting) * latents + e * rotary) / setting.split + up_projection_inputs
    else:  # the up-projection's input is a view of the down-projection's output, kept whole
        kept = up_projection_inputs + e * rotary / setting.linear_input_split
    terms = {"latents": kept, "keys and values": e * a * (model.qk_head_dim + model.v_head_dim) / t,
             "queries and keys": e * 2 * a * key_width / t, "attention output": e * a * model.v_head_dim / t}
    if _context_parallel(setting):
        terms.update(_latent_context_parallel_core(model, setting))
        return terms
    terms.update(_core_terms(model, setting, model.seq_length))
    if "attention scores" in terms and setting.traits.attention_math_copies_qkv:
        terms["queries and keys"] = setting._bytes(setting.traits.attention_math_bytes) * 2 * a * key_width / t
    return terms


def _core_terms(model: ModelConfig, setting: ActivationSetting, keys: float) -> dict[str, float]:
    """What the core attention keeps beyond its inputs and output: the scores of each query's ``keys`` (with
    dropout, its mask and the dropped probabilities) on the math path, the softmax statistics with flash, nothing
    recomputed."""
    a, t = model.num_attention_heads, setting.tensor_model_parallel_size
    if setting.selective_recompute:
        return {}  # the core's s^2 tensors (or flash statistics) are recomputed
    if _uses_flash(model, setting):
        return {"softmax statistics": 4 * a / t}
    return {"attention scores": _score_bytes(model, setting) * a * keys / t}


def _score_bytes(model: ModelConfig, setting: ActivationSetting) -> int:
    """Bytes the math path keeps per (query, key, head): the softmax output; with dropout also its mask and the
    dropped probabilities."""
    math_bytes = setting._bytes(setting.traits.attention_math_bytes)
    if model.attention_dropout == 0:
        return math_bytes
    mask = setting.traits.attention_dropout_mask_bytes
    return 2 * math_bytes + (math_bytes if mask is None else mask)


@dataclass(frozen=True)
class AllGatherCalls:
    """What the all_gather core's calls on one rank's two chunks of the sequence add up to: each chunk against the
    keys up to its end in one call, or on a chunked layer (``model/chunked_attention.py``) its attention chunks'
    calls at its global columns (``ChunkedAttention.folded_calls``, the folded form of an unpacked sequence).

    Per token of the rank: ``keys_seen``, the share of the sequence's keys each query attends to;
    ``keys_handed``, the keys (and values) handed to the calls over 4 chunk lengths (cp x ``keys_seen``
    without chunks); ``folded``, the share of queries in calls that fold whole attention chunks into the batch,
    which copies their queries, keys and values. ``views``: whether some call takes slices of the queries and
    of the gathered keys and values, which keeps those whole. Per micro-batch row: ``mask_entries``, the (query,
    key) entries of the causal masks of calls whose queries are not all their keys (aligned to the last key)."""

    keys_seen: float
    keys_handed: float
    folded: float
    views: bool
    mask_entries: float

    @classmethod
    def of_ranks(cls, model: ModelConfig, setting: ActivationSetting, layer_number: int) -> list["AllGatherCalls"]:
        """Every context-parallel rank's, in rank order."""
        cp, chunks = setting.context_parallel_size, layer_chunks(model, layer_number)
        chunk = model.seq_length // (2 * cp)
        ranks = []
        for rank in range(cp):
            calls = []
            for chunk_id in chunk_ids(rank, cp):
                end = (chunk_id + 1) * chunk
                calls += ([(chunk, end, 1)] if chunks is None else
                          [(q.stop - q.start, k.stop - k.start, n) for q, k, n in chunks.folded_calls(chunk, end)])
            ranks.append(cls(keys_seen=sum(q * k / n for q, k, n in calls) / (2 * chunk * model.seq_length),
                             keys_handed=sum(k for _, k, _ in calls) / (4 * chunk),
                             folded=sum(q for q, _, n in calls if n > 1) / (2 * chunk),
                             views=any(n == 1 for _, _, n in calls),
                             mask_entries=sum(q * k for q, k, _ in calls if q != k)))
        return ranks


def _context_parallel_core(model: ModelConfig, setting: ActivationSetting, layer_number: int) -> dict[str, float]:
    """Bytes per token of this rank that the context-parallel core keeps (``context_parallel/attention.py``).

    p2p: its own query, key and value as given (views of the fused QKV, or RoPE's copies) and the fp32
    log-sum-exp; the ring's blocks and their probabilities are not kept, whatever the kernel (nor, on a chunked
    layer, the chunks' masks).
    all_gather: the whole sequence's gathered keys and values (cp times this rank's), and the layer's own
    core on each chunk against the keys up to its end, or on a chunked layer against its attention chunks'
    (``AllGatherCalls``): grouped-query keys and values repeated over that span, the math path's s^2 tensors
    over it; a chunked layer's folded calls keep copies of their queries, keys and values, and where every call
    folds, nothing keeps the gathered keys and values. The fullest rank's.
    """
    if setting.cp_comm_type == "p2p":
        a, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
        t, fused_qkv = setting.tensor_model_parallel_size, (a + 2 * g) * d
        kept = (a * d + g * d + fused_qkv) if model.position_embedding_type == "rope" else fused_qkv
        return {"query, key, value": setting.dtype_bytes * kept / t, "softmax statistics": 4 * a / t}
    return max((_all_gather_core(model, setting, calls) for calls in AllGatherCalls.of_ranks(
        model, setting, layer_number)), key=lambda terms: sum(terms.values()))


def _all_gather_core(model: ModelConfig, setting: ActivationSetting, calls: AllGatherCalls) -> dict[str, float]:
    """``_context_parallel_core``'s all_gather terms of one rank's ``calls`` (the value is a view of the fused QKV
    without RoPE, which copies the query and key)."""
    a, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    t, e, cp = setting.tensor_model_parallel_size, setting.dtype_bytes, setting.context_parallel_size
    rope, fused_qkv = model.position_embedding_type == "rope", (a + 2 * g) * d
    terms = {"query, key, value": e * (a * d if rope else fused_qkv) * calls.views / t,
             "gathered keys and values": e * 2 * g * d * cp * calls.views / t}
    if calls.folded:
        terms["folded query, key, value"] = e * fused_qkv * calls.folded / t
    if g != a:
        terms["grouped keys and values"] = e * 2 * a * d * calls.keys_handed / t
    terms.update(_all_gather_core_terms(model, setting, calls))
    if "attention scores" in terms and setting.traits.attention_math_copies_qkv:
        math_bytes = setting._bytes(setting.traits.attention_math_bytes)
        terms["query, key, value"] = math_bytes * (a * d + 2 * a * d * calls.keys_handed) / t
        terms.pop("folded query, key, value", None)  # the math path keeps its own copies instead
    return terms


def _latent_context_parallel_core(model: ModelConfig, setting: ActivationSetting) -> dict[str, float]:
    """``_context_parallel_core`` for multi-latent attention, whose queries, keys and values it already counts
    (``_latent_attention_terms``): p2p keeps them as given and the log-sum-exp; all_gather the whole sequence's
    keys and values of this rank's heads (dk + dv wide), and its core's tensors over the keys each chunk sees."""
    a, t, e = model.num_attention_heads, setting.tensor_model_parallel_size, setting.dtype_bytes
    key_width, cp = model.qk_head_dim + model.qk_pos_emb_head_dim, setting.context_parallel_size
    if setting.cp_comm_type == "p2p":
        return {"softmax statistics": 4 * a / t}
    (calls, *_) = AllGatherCalls.of_ranks(model, setting, 0)  # no chunks: latent attention has none, every rank alike
    terms = {"gathered keys and values": e * a * (key_width + model.v_head_dim) * cp / t}
    terms.update(_all_gather_core_terms(model, setting, calls))
    if "attention scores" in terms and setting.traits.attention_math_copies_qkv:
        math_bytes = setting._bytes(setting.traits.attention_math_bytes)
        terms["queries and keys"] = math_bytes * a * key_width * (1 + calls.keys_handed) / t
    return terms


def _all_gather_core_terms(model: ModelConfig, setting: ActivationSetting, calls: AllGatherCalls
                           ) -> dict[str, float]:
    """What the all_gather core keeps beyond its inputs: the flash statistics, or the math path's s^2 tensors over
    the keys each chunk sees."""
    a, s, t = model.num_attention_heads, model.seq_length, setting.tensor_model_parallel_size
    if _uses_flash(model, setting):
        return {"softmax statistics": 4 * a / t}
    return {"attention scores": _score_bytes(model, setting) * a * s * calls.keys_seen / t}


def context_parallel_mask_bytes(model: ModelConfig, setting: ActivationSetting, layer_number: int = 0) -> float:
    """Bytes per micro-batch (whatever its size) layer ``layer_number`` keeps for the causal masks of its
    all_gather core: each of a rank's two chunks (c = s / 2cp positions) against the keys up to its end, c^2
    (2cp + 1) entries, or a chunked layer's calls whose queries start inside an attention chunk
    (``AllGatherCalls``)."""
    cp = setting.context_parallel_size
    if cp == 1 or setting.cp_comm_type != "all_gather" or setting.selective_recompute \
            or not _uses_flash(model, setting):
        return 0.0
    return setting.traits.lower_right_causal_mask_bytes * max(
        calls.mask_entries for calls in AllGatherCalls.of_ranks(model, setting, layer_number))



def layer_bytes_per_token(model: ModelConfig, setting: ActivationSetting, layer_number: int = 0,
                          expert_tensor_parallel_size: int = 1) -> float:
    return sum(layer_terms(model, setting, layer_number, expert_tensor_parallel_size).values())


def embedding_bytes_per_token(model: ModelConfig, setting: ActivationSetting) -> float:
    """The first stage's token (and position) ids and its dropout mask."""
    ids = 8 * (2 if model.position_embedding_type == "learned_absolute" else 1)
    mask = setting._bytes(setting.traits.embedding_dropout_mask_bytes) if model.hidden_dropout > 0 else 0
    return ids + mask * model.hidden_size / setting.split


def output_bytes_per_token(model: ModelConfig, setting: ActivationSetting, padded_vocab_size: int) -> float:
    """The last stage's final-norm input, output-layer input and the fp32 softmax the loss keeps."""
    traits, h, t = setting.traits, model.hidden_size, setting.tensor_model_parallel_size
    norm = setting._bytes(traits.layer_norm_bytes if model.normalization == "LayerNorm" else traits.rms_norm_bytes)
    return (norm * h / setting.split + setting.dtype_bytes * h / setting.linear_input_split
            + 4 * padded_vocab_size / t + 8)


def loss_transient_bytes_per_token(setting: ActivationSetting, padded_vocab_size: int) -> float:
    """Working memory of the cross entropy beyond what it keeps: over tensor-parallel ranks, two more fp32
    copies of the logits (shifted and exponentiated) while it runs; on one rank (the fused log_softmax
    form) none, but for 16-bit logits their fp32 copy."""
    if setting.tensor_model_parallel_size == 1:
        return 0 if setting.dtype_bytes == 4 else 4 * padded_vocab_size
    return 2 * 4 * padded_vocab_size / setting.tensor_model_parallel_size


def entropy_transient_bytes_per_token(setting: ActivationSetting, padded_vocab_size: int) -> float:
    """--grpo's logged entropy (``vocab_parallel_entropy``), computed after the loss from the same fp32 logits: two
    fp32 copies of this rank's logits (shifted and exponentiated) while it runs, on top of what the loss holds
    then."""
    return 2 * 4 * padded_vocab_size / setting.tensor_model_parallel_size


def recomputed_input_bytes_per_token(model: ModelConfig, setting: ActivationSetting) -> float:
    """Full recomputation keeps a recomputed group's input only: [s, b, h] (over t with sequence parallelism)."""
    return setting.dtype_bytes * model.hidden_size / setting.split
