"""Hugging Face weights and config.json (GPT-2, GPT-NeoX, Llama, Qwen2/2.5, Qwen3, Mistral, Mixtral, Qwen3-MoE,
OLMoE, OLMo 2 and 3, Phi-3, Gemma 2 and 3, DeepSeek-V2/V3, SmolLM3, GLM-4.5, gpt-oss, Llama 4) <-> our ModelConfig
and global tensors.

The directories and whole checkpoints are ``interop.hf.checkpoint``'s; this module maps one family's
``config.json`` to our ModelConfig and its tensors to our global tensors, and back.

What differs between the two naming schemes:

- Attention: HF keeps separate (Llama) or concatenated [all q; all k; all v] (GPT-2)
  projections; ours is one fused weight laid out per query group,
  [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...], so a
  tensor-parallel shard holds whole groups. HF Llama's rotary embedding rotates
  halves of each head (rotate-half), as ours does: no permutation of q/k rows.
- GPT-2's ``Conv1D`` stores weights as [in, out]; ``nn.Linear`` (ours, Llama) as [out, in].
- GPT-NeoX's query_key_value is fused per head, [q_h, k_h, v_h] for each head h: ours with one key/value
  group per head, copied as it is; its output layer is embed_out, outside the gpt_neox. prefix.
- SwiGLU: ours is one fc1 = [gate; up]; Llama has gate_proj and up_proj.
- Qwen2's q/k/v biases are packed as their weights are; Qwen3's q_norm/k_norm are our
  q_layernorm/k_layernorm. Which ``config.json`` fields each family has: ``families``.
- Gemma 2 and 3 name their four norms input_layernorm, post_attention_layernorm (after attention, not
  before the MLP as Llama's), pre_feedforward_layernorm and post_feedforward_layernorm, and store
  their weights (Gemma 3's q_norm/k_norm too) as scale - 1, as ours do with --apply-layernorm-1p:
  they are copied unchanged.
- OLMo 2 and 3 have no norms before the sublayers, and name the two after them post_attention_layernorm and
  post_feedforward_layernorm (the ``olmo2`` naming); their q_norm/k_norm span the whole projection, as OLMoE's.
- Mixtral's experts (block_sparse_moe.experts.{e}.w1/w3/w2: gate, up, down) become our experts by the same
  number, w1 and w3 fused into fc1 as SwiGLU's [gate; up]; its router (block_sparse_moe.gate) is ours.
  Qwen3-MoE and OLMoE name them mlp.experts.{e}.gate_proj/up_proj/down_proj and the router mlp.gate;
  Qwen3-MoE's dense layers (mlp_only_layers) are Llama's MLPs. OLMoE's q_norm/k_norm span the whole
  projection (all heads), but are copied as Qwen3's are: only their width differs.
- DeepSeek's multi-latent attention: ``latent_attention`` (renames, and its interleaved rotary rows). Its
  experts are named as Qwen3-MoE's, its shared experts mlp.shared_experts.gate_proj/up_proj/down_proj (our
  shared_experts' fc1 and fc2), and V3's mlp.gate.e_score_correction_bias is our router's expert_bias.
- GLM-4.5 (naming glm4_moe): Llama's names (q/k/v biases as Qwen2's, q_norm/k_norm as Qwen3's), DeepSeek's experts.
- gpt-oss: Llama's names, q/k/v/o biases, and its sinks, router and fused experts (``gpt_oss_weights``).
- Llama 4: Llama's names for attention and norms, with q/k rows reordered from its interleaved rotary pairs, and
  its MLPs as feed_forward, experts stacked (``llama4_weights``).
- Qwen3-Next and Qwen3.5: their gated DeltaNet layers' linear_attn tensors are ``qwen3_next``'s to convert; a
  gated attention's q_proj rows are [q; gate] per head, ours [q heads; their gates] per query group
  (``pack_qkv``); the shared expert is mlp.shared_expert (our shared_experts) with mlp.shared_expert_gate (our
  shared_experts.gate_weight). Their norms are zero-centred as Gemma's, copied unchanged.
- Vocabulary: ours is padded (``ModelConfig.padded_vocab_size``): zero rows are added
  on import and cut on export.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.interop.hf.families import (GEMMA_FEATURES, Family, config_json, family_of,
                                               model_config_fields_from_hf, named_family)
from megatron_lite.interop.hf.gpt_oss_weights import gpt_oss_layer_from_hf, gpt_oss_layer_to_hf
from megatron_lite.interop.hf.latent_attention import latent_attention_from_hf, latent_attention_to_hf
from megatron_lite.interop.hf.llama4_weights import llama4_mlp_from_hf, llama4_mlp_to_hf, llama4_rotary_rows
from megatron_lite.interop.hf.multi_token_prediction import mtp_from_hf, mtp_to_hf
from megatron_lite.interop.hf.qwen3_next import gated_delta_net_from_hf, gated_delta_net_to_hf


# ---------------------------------------------------------------------------------------------
# Configurations (each family's fields: families)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig for a ``config.json`` of a family in ``families``; unsupported fields and variants
    are refused by name."""
    return ModelConfig(**model_config_fields_from_hf(hf))


def hf_architecture(config: ModelConfig) -> str:
    """'gpt2', 'llama', 'gemma' or 'deepseek': the Hugging Face weight naming our model matches exactly (Qwen and
    Mistral name theirs as Llama does, Gemma 3 as Gemma 2; the mixture-of-experts families as Llama but for
    their experts), else a ConfigError."""
    gpt2 = dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
                add_bias_linear=True, num_query_groups=config.num_attention_heads,
                head_dim=config.hidden_size // config.num_attention_heads, qk_layernorm=False, window_size=None,
                multi_latent_attention=False, **GEMMA_FEATURES)
    llama = dict(normalization="RMSNorm", rotary=True, swiglu=True, add_bias_linear=False, rotary_percent=1.0,
                 multi_latent_attention=False, **GEMMA_FEATURES)
    gemma = dict(normalization="RMSNorm", rotary=True, swiglu=True, geglu=True, add_bias_linear=False,
                 add_qkv_bias=False, rotary_percent=1.0, apply_layernorm_1p=True, post_sublayer_norm=True,
                 no_pre_sublayer_norm=False, scale_embeddings=True, multi_latent_attention=False)
    qwen3_next = dict(normalization="RMSNorm", rotary=True, swiglu=True, add_bias_linear=False, apply_layernorm_1p=True,
                      attention_output_gate=True, multi_latent_attention=False, **GEMMA_FEATURES)
    olmo2 = {**{k: v for k, v in llama.items() if k != "window_attn_skip_freq"},  # OLMo 3's global layers
             "post_sublayer_norm": True, "no_pre_sublayer_norm": True}
    deepseek = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, multi_latent_attention=True,
                    qk_layernorm=True, window_size=None, **GEMMA_FEATURES)
    gpt_neox = {**{k: v for k, v in gpt2.items() if k != "position_embedding_type"}, "rotary": True}
    # Llama's names with biases on every linear, sinks and fused, biased experts in every layer.
    gpt_oss = dict(llama, add_bias_linear=True, softmax_type="learnable", qk_layernorm=False)
    for name, required in (("gpt2", gpt2), ("gpt_neox", gpt_neox), ("qwen3_next", qwen3_next), ("llama", llama),
                           ("gemma", gemma), ("olmo2", olmo2), ("deepseek", deepseek),
                           ("gpt_oss", gpt_oss)):
        if all(getattr(config, k) == v for k, v in required.items()):
            return name
    raise ConfigError("this model is neither GPT-2 (LayerNorm, learned positions, GELU, biases, no GQA, head width "
                      "hidden / heads) nor GPT-NeoX (GPT-2's with rotary positions) nor Llama-like (RMSNorm, rope "
                      "on every channel, SwiGLU, no biases but --add-qkv-bias) nor Gemma (Llama's with "
                      "--apply-layernorm-1p, --post-sublayer-norm, "
                      "--scale-embeddings and --geglu), OLMo 2 (Llama's with --post-sublayer-norm and "
                      "--no-pre-sublayer-norm), DeepSeek (Llama's with --multi-latent-attention and --qk-layernorm), "
                      "gpt-oss (Llama's with biases and --softmax-type learnable) nor Qwen3-Next (Llama's with "
                      "--apply-layernorm-1p and --attention-output-gate): Hugging Face has no matching architecture "
                      "to export to.")


def _default_naming(config: ModelConfig) -> str:
    """The weight naming of ``config``'s architecture; with experts, that of the family it exports as."""
    naming = hf_architecture(config)
    return family_of(config, naming).naming if config.num_experts is not None and naming == "llama" else naming


def hf_family(config: ModelConfig, model_type: str | None = None) -> Family:
    """The family to export as: ``model_type`` if given, else the one the model was imported as, else the one
    the model's features call for; either way one whose config.json describes the model exactly (read back,
    it computes the same)."""
    return named_family(config, model_type or config.hf_model_type
                        or family_of(config, hf_architecture(config)).model_type)


def hf_config_from_model_config(config: ModelConfig, model_type: str | None = None) -> dict:
    """The ``config.json`` transformers needs to rebuild our model."""
    return config_json(hf_family(config, model_type), config)


# ---------------------------------------------------------------------------------------------
# The fused QKV layout


def pack_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """[heads*d, ...], [groups*d, ...], [groups*d, ...] -> our fused [groups*(heads/groups + 2)*d, ...]. With
    --attention-output-gate the query rows are [q; gate] per head (Qwen3-Next's q_proj), ours [q heads; their
    gates] per group."""
    groups, d = config.num_query_groups, config.head_dim
    rest = query.shape[1:]
    if config.attention_output_gate:  # [group, head, q or gate, d] -> [group, q or gate, head, d]
        query = query.reshape(groups, -1, 2, d, *rest).transpose(1, 2)
    parts = [query.reshape(groups, -1, *rest), key.reshape(groups, d, *rest), value.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unpack_qkv(fused: torch.Tensor, config: ModelConfig) -> tuple:
    """Inverse of ``pack_qkv``: (query, key, value)."""
    groups, d = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups * d * (2 if config.attention_output_gate else 1)
    rest = fused.shape[1:]
    query, key, value = fused.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    if config.attention_output_gate:
        query = query.reshape(groups, 2, -1, d, *rest).transpose(1, 2)
    return tuple(t.reshape(-1, *rest) for t in (query, key, value))


# ---------------------------------------------------------------------------------------------
# Weights


def _vocab_padded(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    padding = config.padded_vocab_size(1) - weight.shape[0]
    return torch.cat([weight, weight.new_zeros(padding, weight.shape[1])])


# (theirs, ours, transposed): tensors that only change name (and GPT-2's Conv1D weights orientation). One
# table serves import and export, so the two directions cannot drift apart. Layer names are per layer.
_GPT2_LAYER = (("attn.c_proj.weight", "self_attention.linear_proj.weight", True),
               ("attn.c_proj.bias", "self_attention.linear_proj.bias", False),
               ("mlp.c_fc.weight", "mlp.linear_fc1.weight", True),
               ("mlp.c_fc.bias", "mlp.linear_fc1.bias", False),
               ("mlp.c_proj.weight", "mlp.linear_fc2.weight", True),
               ("mlp.c_proj.bias", "mlp.linear_fc2.bias", False),
               ("ln_1.weight", "input_layernorm.weight", False), ("ln_1.bias", "input_layernorm.bias", False),
               ("ln_2.weight", "pre_mlp_layernorm.weight", False), ("ln_2.bias", "pre_mlp_layernorm.bias", False))
_GPT2_FINAL = (("wpe.weight", "embedding.position_embeddings.weight", False),
               ("ln_f.weight", "final_layernorm.weight", False), ("ln_f.bias", "final_layernorm.bias", False))
_GPT_NEOX_LAYER = (("attention.query_key_value.weight", "self_attention.linear_qkv.weight", False),
                   ("attention.query_key_value.bias", "self_attention.linear_qkv.bias", False),
                   ("attention.dense.weight", "self_attention.linear_proj.weight", False),
                   ("attention.dense.bias", "self_attention.linear_proj.bias", False),
                   ("mlp.dense_h_to_4h.weight", "mlp.linear_fc1.weight", False),
                   ("mlp.dense_h_to_4h.bias", "mlp.linear_fc1.bias", False),
                   ("mlp.dense_4h_to_h.weight", "mlp.linear_fc2.weight", False),
                   ("mlp.dense_4h_to_h.bias", "mlp.linear_fc2.bias", False),
                   ("input_layernorm.weight", "input_layernorm.weight", False),
                   ("input_layernorm.bias", "input_layernorm.bias", False),
                   ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", False),
                   ("post_attention_layernorm.bias", "pre_mlp_layernorm.bias", False))
_GPT_NEOX_FINAL = (("final_layer_norm.weight", "final_layernorm.weight", False),
                   ("final_layer_norm.bias", "final_layernorm.bias", False))
# Each naming's prefix of the decoder's weights and name of the untied output layer (default: Llama's).
_PREFIXES = {"gpt2": "transformer.", "gpt_neox": "gpt_neox."}
_OUTPUT_LAYERS = {"gpt_neox": "embed_out.weight"}
_LLAMA_PROJECTIONS = (("self_attn.o_proj.weight", "self_attention.linear_proj.weight", False),
                      ("input_layernorm.weight", "input_layernorm.weight", False))
_LLAMA_MLP = (("mlp.down_proj.weight", "mlp.linear_fc2.weight", False),)
# A mixture-of-experts layer's router and each expert's (gate, up, down) projections, by weight naming;
# "{e}" is the expert's number. Ours: mlp.router.weight, mlp.experts.local_experts.{e}.linear_fc1 = [gate; up].
class ExpertNames(NamedTuple):
    router: str
    expert: str  # "{e}": the expert's number
    projections: tuple  # (gate, up, down)
    shared: str | None = None  # the shared experts' MLP (gate_proj, up_proj, down_proj), as one of ours
    shared_gate: str | None = None  # the shared expert's sigmoid gate (our shared_experts.gate_weight)
    expert_bias: str | None = None  # the router's bias on the scores that choose (our expert_bias)


_QWEN_PROJECTIONS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
_EXPERT_NAMES = {"mixtral": ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.",
                                        ("w1.weight", "w3.weight", "w2.weight")),
                 "qwen_moe": ExpertNames("mlp.gate.weight", "mlp.experts.{e}.", _QWEN_PROJECTIONS),  # Qwen3-MoE, OLMoE
                 "deepseek": ExpertNames("mlp.gate.weight", "mlp.experts.{e}.", _QWEN_PROJECTIONS,
                                         shared="mlp.shared_experts.", expert_bias="mlp.gate.e_score_correction_bias"),
                 "qwen3_next": ExpertNames("mlp.gate.weight", "mlp.experts.{e}.", _QWEN_PROJECTIONS,
                                           shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight")}
_EXPERT_NAMES["glm4_moe"] = _EXPERT_NAMES["deepseek"]  # GLM-4.5: Llama's attention, DeepSeek's experts
_LLAMA_LAYER = _LLAMA_PROJECTIONS + (("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", False),)
_GEMMA_LAYER = _LLAMA_PROJECTIONS + (
    ("post_attention_layernorm.weight", "post_self_attn_layernorm.weight", False),
    ("pre_feedforward_layernorm.weight", "pre_mlp_layernorm.weight", False),
    ("post_feedforward_layernorm.weight", "post_mlp_layernorm.weight", False))
# OLMo 2 and 3: norms after the sublayers alone, post_attention_layernorm the one after attention (as Gemma's).
_OLMO2_LAYER = (("self_attn.o_proj.weight", "self_attention.linear_proj.weight", False),
                ("post_attention_layernorm.weight", "post_self_attn_layernorm.weight", False),
                ("post_feedforward_layernorm.weight", "post_mlp_layernorm.weight", False))
_LLAMA_FINAL = (("norm.weight", "final_layernorm.weight", False),)
# Qwen3's per-head query and key norms (--qk-layernorm).
_QK_NORMS = (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", False),
             ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", False))


# Namings whose norm weights are stored as scale - 1, as ours with --apply-layernorm-1p.
ZERO_CENTRED_NAMINGS = frozenset({"gemma", "qwen3_next", "qwen3_5"})


def _llama_layer_table(config: ModelConfig, number: int) -> tuple:
    if config.is_linear_attention_layer(number):  # the norms only: the linear attention is qwen3_next's
        return _LLAMA_LAYER[1:]
    qk_norms = _QK_NORMS if config.qk_layernorm and not config.multi_latent_attention else ()  # MLA's: its own
    if config.no_pre_sublayer_norm:
        return _OLMO2_LAYER + qk_norms
    return (_GEMMA_LAYER if config.post_sublayer_norm else _LLAMA_LAYER) + qk_norms


def _renamed_from_hf(take, table, theirs_prefix: str, ours_prefix: str) -> dict:
    return {ours_prefix + mine: take(theirs_prefix + theirs).t() if transposed else take(theirs_prefix + theirs)
            for theirs, mine, transposed in table}


def _renamed_to_hf(read, table, theirs_prefix: str, ours_prefix: str) -> dict:
    return {theirs_prefix + theirs: read(ours_prefix + mine).t() if transposed else read(ours_prefix + mine)
            for theirs, mine, transposed in table}


def weights_from_hf(tensors: dict, config: ModelConfig, naming: str | None = None, *,
                    interleaved_rope: bool = True) -> dict:
    """HF state dict -> our global tensors by name (vocabulary padded for tensor-parallel size 1). ``naming``:
    the family's (``families``), by default the one the model's features say; ``interleaved_rope``: whether
    DeepSeek's rotary rows are interleaved (``latent_attention``)."""
    naming = naming or _default_naming(config)
    # Checkpoints saved from the bare GPT2Model / LlamaModel lack the prefix.
    prefix = _PREFIXES.get(naming, "model.")
    tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
    ours = {}

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"the Hugging Face weights have no {name!r}, which its config.json implies: the "
                              f"files are incomplete, or of another model.")
        return tensors.pop(name)

    if naming == "gpt2":
        ours["embedding.word_embeddings.weight"] = _vocab_padded(take("wte.weight"), config)
        for i in range(config.num_layers):
            hf, layer = f"h.{i}.", f"decoder.layers.{i}."
            query, key, value = take(hf + "attn.c_attn.weight").t().chunk(3, dim=0)
            ours[layer + "self_attention.linear_qkv.weight"] = pack_qkv(query, key, value, config)
            ours[layer + "self_attention.linear_qkv.bias"] = pack_qkv(*take(hf + "attn.c_attn.bias").chunk(3), config)
            ours.update(_renamed_from_hf(take, _GPT2_LAYER, hf, layer))
            for buffer in (hf + "attn.bias", hf + "attn.masked_bias"):  # causal-mask buffers of older files
                tensors.pop(buffer, None)
        ours.update(_renamed_from_hf(take, _GPT2_FINAL, "", ""))
    elif naming == "gpt_neox":
        ours["embedding.word_embeddings.weight"] = _vocab_padded(take("embed_in.weight"), config)
        for i in range(config.num_layers):
            ours.update(_renamed_from_hf(take, _GPT_NEOX_LAYER, f"layers.{i}.", f"decoder.layers.{i}."))
            for buffer in ("attention.bias", "attention.masked_bias"):  # causal-mask buffers of older files
                tensors.pop(f"layers.{i}.{buffer}", None)
        ours.update(_renamed_from_hf(take, _GPT_NEOX_FINAL, "", ""))
    else:
        ours["embedding.word_embeddings.weight"] = _vocab_padded(take("embed_tokens.weight"), config)
        for i in range(config.num_layers):
            ours.update(_llama_layer_from_hf(take, f"layers.{i}.", f"decoder.layers.{i}.", config, naming, i,
                                             interleaved_rope=interleaved_rope))
        ours.update(_renamed_from_hf(take, _LLAMA_FINAL, "", ""))
    output_layer = _OUTPUT_LAYERS.get(naming, "lm_head.weight")
    lm_head = tensors.pop(output_layer, None)
    if config.untie_embeddings_and_output_weights:
        if lm_head is None:
            raise ConfigError(f"config.json says tie_word_embeddings is false but the weights have no {output_layer}.")
        ours["output_layer.weight"] = _vocab_padded(lm_head, config)
    if config.mtp_num_layers is not None:
        ours.update(mtp_from_hf(take, tensors, ours, config, functools.partial(
            _llama_layer_from_hf, take, config=config, naming=naming, interleaved_rope=interleaved_rope)))
    leftover = sorted(k for k in tensors if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ConfigError(f"Hugging Face weights not understood (a different architecture?): {leftover[:5]}")
    return {name: t.contiguous() for name, t in ours.items()}


def weights_to_hf(read, config: ModelConfig, naming: str | None = None) -> dict:
    """Our global tensors (``read(name)``) -> HF state dict (vocabulary padding cut), named as ``weights_from_hf``."""
    naming = naming or _default_naming(config)
    vocab = config.vocab_size
    if config.apply_layernorm_1p and naming not in ZERO_CENTRED_NAMINGS:
        read = _with_unit_norm_scale(read)
    hf = {}
    if naming == "gpt2":
        hf["transformer.wte.weight"] = read("embedding.word_embeddings.weight")[:vocab]
        for i in range(config.num_layers):
            theirs, layer = f"transformer.h.{i}.", f"decoder.layers.{i}."
            query, key, value = unpack_qkv(read(layer + "self_attention.linear_qkv.weight"), config)
            hf[theirs + "attn.c_attn.weight"] = torch.cat([query, key, value]).t()
            hf[theirs + "attn.c_attn.bias"] = torch.cat(unpack_qkv(read(layer + "self_attention.linear_qkv.bias"),
                                                                   config))
            hf.update(_renamed_to_hf(read, _GPT2_LAYER, theirs, layer))
        hf.update(_renamed_to_hf(read, _GPT2_FINAL, "transformer.", ""))
    elif naming == "gpt_neox":
        hf["gpt_neox.embed_in.weight"] = read("embedding.word_embeddings.weight")[:vocab]
        for i in range(config.num_layers):
            hf.update(_renamed_to_hf(read, _GPT_NEOX_LAYER, f"gpt_neox.layers.{i}.", f"decoder.layers.{i}."))
        hf.update(_renamed_to_hf(read, _GPT_NEOX_FINAL, "gpt_neox.", ""))
    else:
        hf["model.embed_tokens.weight"] = read("embedding.word_embeddings.weight")[:vocab]
        for i in range(config.num_layers):
            hf.update(_llama_layer_to_hf(read, f"model.layers.{i}.", f"decoder.layers.{i}.", config, naming, i))
        hf.update(_renamed_to_hf(read, _LLAMA_FINAL, "model.", ""))
    if config.untie_embeddings_and_output_weights:
        hf[_OUTPUT_LAYERS.get(naming, "lm_head.weight")] = read("output_layer.weight")[:vocab]
    if config.mtp_num_layers is not None:
        hf.update(mtp_to_hf(read, config, functools.partial(_llama_layer_to_hf, read, config=config, naming=naming)))
    return {name: t.contiguous() for name, t in hf.items()}


def _llama_layer_from_hf(take, theirs: str, layer: str, config: ModelConfig, naming: str, number: int, *,
                         interleaved_rope: bool) -> dict:
    """One Llama-named decoder layer's weights (``theirs``, ``layer``: the two prefixes; ``number``: global)."""
    ours = {}
    if naming == "phi3":  # [all q; all k; all v] and [gate; up] in one weight each
        ours[layer + "self_attention.linear_qkv.weight"] = pack_qkv(
            *_split_qkv(take(theirs + "self_attn.qkv_proj.weight"), config), config)
        ours[layer + "mlp.linear_fc1.weight"] = take(theirs + "mlp.gate_up_proj.weight")
        ours.update(_renamed_from_hf(take, _LLAMA_MLP, theirs, layer))
    else:
        if naming == "deepseek":
            ours.update(latent_attention_from_hf(take, theirs, layer, config, interleaved=interleaved_rope))
        elif config.is_linear_attention_layer(number):
            ours.update(gated_delta_net_from_hf(take, theirs, layer, config, naming))
        else:
            query, key = take(theirs + "self_attn.q_proj.weight"), take(theirs + "self_attn.k_proj.weight")
            if naming == "llama4":
                query, key = (llama4_rotary_rows(rows, config, to_interleaved=False) for rows in (query, key))
            ours[layer + "self_attention.linear_qkv.weight"] = pack_qkv(
                query, key, take(theirs + "self_attn.v_proj.weight"), config)
        if naming == "gpt_oss":
            ours.update(gpt_oss_layer_from_hf(take, theirs, layer, config))
        elif naming == "llama4":
            ours.update(llama4_mlp_from_hf(take, theirs, layer, config, number))
        else:
            ours.update(_mlp_from_hf(take, theirs, layer, config, naming, number))
    if config.add_qkv_bias or config.add_bias_linear:  # Qwen2's q/k/v biases, gpt-oss's
        ours[layer + "self_attention.linear_qkv.bias"] = pack_qkv(
            take(theirs + "self_attn.q_proj.bias"), take(theirs + "self_attn.k_proj.bias"),
            take(theirs + "self_attn.v_proj.bias"), config)
    ours.update(_renamed_from_hf(take, _llama_layer_table(config, number), theirs, layer))
    return ours


def _llama_layer_to_hf(read, theirs: str, layer: str, config: ModelConfig, naming: str, number: int) -> dict:
    """Inverse of ``_llama_layer_from_hf``."""
    hf = {}
    if naming == "phi3":
        query, key, value = unpack_qkv(read(layer + "self_attention.linear_qkv.weight"), config)
        hf[theirs + "self_attn.qkv_proj.weight"] = torch.cat([query, key, value])
        hf[theirs + "mlp.gate_up_proj.weight"] = read(layer + "mlp.linear_fc1.weight")
        hf.update(_renamed_to_hf(read, _LLAMA_MLP, theirs, layer))
    else:
        if naming == "deepseek":
            hf.update(latent_attention_to_hf(read, theirs, layer, config))
        elif config.is_linear_attention_layer(number):
            hf.update(gated_delta_net_to_hf(read, theirs, layer, config, naming))
        else:
            query, key, value = unpack_qkv(read(layer + "self_attention.linear_qkv.weight"), config)
            if naming == "llama4":
                query, key = (llama4_rotary_rows(rows, config, to_interleaved=True) for rows in (query, key))
            hf.update({theirs + f"self_attn.{name}_proj.weight": weight
                       for name, weight in zip("qkv", (query, key, value))})
        if naming == "gpt_oss":
            hf.update(gpt_oss_layer_to_hf(read, theirs, layer, config))
        elif naming == "llama4":
            hf.update(llama4_mlp_to_hf(read, theirs, layer, config, number))
        else:
            hf.update(_mlp_to_hf(read, theirs, layer, config, naming, number))
    if config.add_qkv_bias or config.add_bias_linear:
        biases = unpack_qkv(read(layer + "self_attention.linear_qkv.bias"), config)
        hf.update({theirs + f"self_attn.{name}_proj.bias": bias for name, bias in zip("qkv", biases)})
    hf.update(_renamed_to_hf(read, _llama_layer_table(config, number), theirs, layer))
    return hf


def _mlp_from_hf(take, theirs: str, layer: str, config: ModelConfig, naming: str, number: int) -> dict:
    """A Llama-named layer's MLP: gate_proj and up_proj into our fused fc1, or a mixture of experts', every
    expert of it (an expert the files lack is an error; one they have beyond --num-experts is left over)."""
    if not config.is_moe_layer(number):
        return {layer + "mlp.linear_fc1.weight": torch.cat([take(theirs + "mlp.gate_proj.weight"),
                                                            take(theirs + "mlp.up_proj.weight")]),
                **_renamed_from_hf(take, _LLAMA_MLP, theirs, layer)}
    names = _expert_names(naming, config)
    gate, up, down = names.projections
    ours = {layer + "mlp.router.weight": take(theirs + names.router)}
    for e in range(config.num_experts):
        prefix, mine = theirs + names.expert.format(e=e), f"{layer}mlp.experts.local_experts.{e}."
        ours[mine + "linear_fc1.weight"] = torch.cat([take(prefix + gate), take(prefix + up)])
        ours[mine + "linear_fc2.weight"] = take(prefix + down)
    if config.moe_shared_expert_intermediate_size is not None:
        prefix, mine = theirs + names.shared, f"{layer}mlp.shared_experts."
        ours[mine + "linear_fc1.weight"] = torch.cat([take(prefix + gate), take(prefix + up)])
        ours[mine + "linear_fc2.weight"] = take(prefix + down)
    if config.moe_shared_expert_gate:
        ours[f"{layer}mlp.shared_experts.gate_weight"] = take(theirs + names.shared_gate)
    if config.moe_router_enable_expert_bias:
        ours[layer + "mlp.router.expert_bias"] = take(theirs + names.expert_bias).float()
    return ours


def _mlp_to_hf(read, theirs: str, layer: str, config: ModelConfig, naming: str, number: int) -> dict:
    """Inverse of ``_mlp_from_hf``."""
    if not config.is_moe_layer(number):
        gate, up = read(layer + "mlp.linear_fc1.weight").chunk(2)
        return {theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
                **_renamed_to_hf(read, _LLAMA_MLP, theirs, layer)}
    names = _expert_names(naming, config)
    gate_name, up_name, down_name = names.projections
    hf = {theirs + names.router: read(layer + "mlp.router.weight")}
    mlps = [(theirs + names.expert.format(e=e), f"{layer}mlp.experts.local_experts.{e}.")
            for e in range(config.num_experts)]
    if config.moe_shared_expert_intermediate_size is not None:
        mlps.append((theirs + names.shared, f"{layer}mlp.shared_experts."))
    for prefix, mine in mlps:
        gate, up = read(mine + "linear_fc1.weight").chunk(2)
        hf.update({prefix + gate_name: gate, prefix + up_name: up,
                   prefix + down_name: read(mine + "linear_fc2.weight")})
    if config.moe_shared_expert_gate:
        hf[theirs + names.shared_gate] = read(f"{layer}mlp.shared_experts.gate_weight")
    if config.moe_router_enable_expert_bias:
        hf[theirs + names.expert_bias] = read(layer + "mlp.router.expert_bias")
    return hf


def _expert_names(naming: str, config: ModelConfig) -> ExpertNames:
    """How ``naming`` names a mixture-of-experts layer's weights, if it names all of ``config``'s."""
    names = _EXPERT_NAMES[naming]
    if (config.moe_shared_expert_intermediate_size is not None and names.shared is None) or (
            config.moe_router_enable_expert_bias and names.expert_bias is None) or (
            config.moe_shared_expert_gate and names.shared_gate is None):
        raise ConfigError(f"the {naming} naming has no shared expert, shared expert gate or expert bias, which this "
                          f"model has.")
    return names


def _split_qkv(rows: torch.Tensor, config: ModelConfig) -> tuple:
    """[all query heads; all keys; all values] (Phi-3's qkv_proj) -> (query, key, value)."""
    groups_width = config.num_query_groups * config.head_dim
    return rows.split([config.num_attention_heads * config.head_dim, groups_width, groups_width])


def _with_unit_norm_scale(read):
    """``read`` for an --apply-layernorm-1p model: norm weights hold scale - 1, Hugging Face's the scale."""
    def read_scale(name: str) -> torch.Tensor:
        return read(name) + 1 if name.endswith("layernorm.weight") else read(name)
    return read_scale
