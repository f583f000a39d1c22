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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.config import ModelConfig


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
    swiglu_saved_factor: int  # multiples of ffn_hidden_size / t kept by the SwiGLU op
    sequence_parallel_keeps_gathered_input: bool


CUDA_KERNELS = KernelTraits(
    layer_norm_bytes=None, rms_norm_bytes=None, hidden_dropout_mask_bytes=0, embedding_dropout_mask_bytes=1,
    flash_attention="always", attention_math_bytes=None, attention_dropout_mask_bytes=None,
    attention_math_copies_qkv=False, swiglu_saved_factor=2, sequence_parallel_keeps_gathered_input=True)
CPU_REFERENCE = KernelTraits(
    layer_norm_bytes=4, rms_norm_bytes=8, hidden_dropout_mask_bytes=None, embedding_dropout_mask_bytes=None,
    flash_attention="without_dropout", attention_math_bytes=4, attention_dropout_mask_bytes=None,
    attention_math_copies_qkv=True, swiglu_saved_factor=3, sequence_parallel_keeps_gathered_input=True)
KORTHIKANTI = KernelTraits(
    layer_norm_bytes=None, rms_norm_bytes=None, hidden_dropout_mask_bytes=1, embedding_dropout_mask_bytes=1,
    flash_attention="never", attention_math_bytes=None, attention_dropout_mask_bytes=1,
    attention_math_copies_qkv=False, swiglu_saved_factor=2, sequence_parallel_keeps_gathered_input=False)
TRAITS = {"cuda": CUDA_KERNELS, "cpu": CPU_REFERENCE}


@dataclass(frozen=True)
class ActivationSetting:
    """Everything besides the model that decides what a layer keeps."""

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    dtype_bytes: int = 2
    selective_recompute: bool = False
    traits: KernelTraits = CUDA_KERNELS

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
    h, a, d, s = model.hidden_size, model.num_attention_heads, model.head_dim, model.seq_length
    t, e, traits = setting.tensor_model_parallel_size, setting.dtype_bytes, setting.traits
    norm = setting._bytes(traits.layer_norm_bytes if model.normalization == "LayerNorm" else traits.rms_norm_bytes)
    terms = {"norm inputs": 2 * norm * h / setting.split,
             "attention and MLP inputs": 2 * e * h / setting.linear_input_split,
             "query, key, value": e * _query_key_value(model, setting),
             "attention output": e * a * d / t}
    math_bytes = setting._bytes(traits.attention_math_bytes)
    if setting.selective_recompute:
        pass  # the core's s^2 tensors (or flash statistics) are recomputed
    elif _uses_flash(model, setting):
        terms["softmax statistics"] = 4 * a / t
    else:
        # The softmax output; with dropout also its mask and the dropped probabilities.
        scores = math_bytes
        if model.attention_dropout > 0:
            mask = traits.attention_dropout_mask_bytes
            scores += math_bytes + (math_bytes if mask is None else mask)
        terms["attention scores"] = scores * a * s / t
        if traits.attention_math_copies_qkv:
            terms["query, key, value"] = math_bytes * (3 * a * d) / t
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
    """Working memory of the cross entropy beyond what it keeps: two more fp32 copies of the logits
    (shifted and exponentiated) while it runs."""
    return 2 * 4 * padded_vocab_size / setting.tensor_model_parallel_size


def recomputed_input_bytes_per_token(model: ModelConfig, setting: ActivationSetting) -> float:
    """Full recomputation keeps a recomputed group's input only: [s, b, h] (over t with sequence parallelism)."""
    return setting.dtype_bytes * model.hidden_size / setting.split
