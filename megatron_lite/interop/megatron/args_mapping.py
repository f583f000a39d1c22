"""Megatron-LM's saved ``args`` <-> our ModelConfig, refusing by name what we do not implement.

The gotchas (docs/reference.md, section 13 "Megatron-LM checkpoints"):

- ``num_query_groups`` is 1 in ``args`` when ``--group-query-attention`` is off: the
  model then has one group per head.
- The norm epsilon was ``layernorm_epsilon`` before Megatron-Core renamed it ``norm_epsilon``.
- GeLU: Megatron computes the tanh approximation when ``bias_gelu_fusion`` is on (its
  default: the fused kernel is the tanh one) and the exact erf otherwise (Megatron-Core's
  ``F.gelu``): our --gelu-exact, read from and written back to ``bias_gelu_fusion``.
- The vocabulary: ``args`` hold ``padded_vocab_size`` (every embedding row, the padding
  rows included, is a trained parameter); the tokenizer's own size is not always saved.
  Our vocabulary is the padded one, so the logits keep Megatron's width; but for a model we
  exported, whose padding rows are ours (zeros), the model's own size rides along in
  ``unpadded_vocab_size`` and the padding rows are cut on the way back.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron_lite.checkpointing.architecture import defines_function
from megatron_lite.config import Config, ConfigError, ModelConfig, TrainingConfig
from megatron_lite.config.moe import parse_moe_layer_freq

# args that change what the model computes and that megatron_lite does not implement or map: (name, what it is).
_UNSUPPORTED = (("moe_latent_size", "latent experts"),
                ("moe_input_jitter_eps", "router input jitter"),
                ("multi_latent_attention", "multi-latent attention"),
                ("squared_relu", "squared ReLU"), ("openai_gelu", "OpenAI's GeLU"),
                ("mtp_use_repeated_layer", "one multi-token prediction layer repeated at every depth"),
                ("mtp_detach_heads", "multi-token prediction layers detached from the decoder's gradient"),
                ("mtp_hsm", "multi-token prediction's hidden state mixing"),
                ("mtp_hybrid_override_pattern", "hybrid (Mamba) multi-token prediction layers"),
                ("apply_residual_connection_post_layernorm", "residuals after the norm"),
                ("rotary_interleaved", "interleaved rotary embeddings"),
                ("heterogeneous_layers_config_path", "heterogeneous layers"),
                # The gated DeltaNet (gdn) megatron_lite computes, but Megatron-LM builds it with Transformer
                # Engine's fused norm-linear and the fla kernels only, so no checkpoint of it has been read here
                # (Qwen3-Next and Qwen3.5 import from Hugging Face).
                ("experimental_attention_variant", "an experimental attention variant, whose Megatron-LM layout "
                                                   "is not mapped"),
                # Llama 4's, which megatron_lite computes but this conversion does not map (Megatron-LM's --qk-l2-norm
                # also normalises the NoPE layers, ours not)
                ("qk_l2_norm", "query/key L2 norms"),
                ("moe_apply_probs_on_input", "router probabilities applied to the expert input"))


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


def refuse_unsupported(args, source: str) -> None:
    """One ConfigError naming every model-changing arg of ``args`` that megatron_lite does not implement."""
    found = unsupported_settings(args)
    if found:
        raise ConfigError(f"the Megatron-LM checkpoint {source} was trained with settings megatron_lite does not "
                          f"implement or map: {', '.join(found)}.")


def unsupported_settings(args) -> list[str]:
    """The model-changing args of ``args`` that megatron_lite does not implement (or does not map), as flags."""
    found = [f"--{name.replace('_', '-')} ({what})" for name, what in _UNSUPPORTED
             if what is not None and _arg(args, name) not in (None, False, 0)]
    if _arg(args, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        found.append(f"--normalization {args.normalization}")
    if _position_embedding_type(args) not in ("learned_absolute", "rope", "yarn"):
        found.append(f"--position-embedding-type {args.position_embedding_type}")
    if isinstance(_arg(args, "window_attn_skip_freq"), list):
        found.append("--window-attn-skip-freq as a list (a pattern of windowed layers; megatron_lite takes every "
                     "Nth layer global)")
    if _arg(args, "swiglu") and _arg(args, "bias_swiglu_fusion", True) and (
            _arg(args, "glu_linear_offset") or _arg(args, "activation_func_clamp_value") is not None):
        found.append("--glu-linear-offset or --activation-func-clamp-value with --swiglu and its fusion (Megatron-LM's "
                     "fused SwiGLU leaves them out; its unfused one, --no-bias-swiglu-fusion, applies them)")
    if _arg(args, "mtp_num_layers"):
        # Megatron-LM numbers a multi-token prediction layer by its depth (1, 2, ...) where it picks a layer's
        # window or rotary embedding; ours take the decoder's last layer's kind.
        found += [f"--mtp-num-layers with --{name.replace('_', '-')} (multi-token prediction layers whose {what} "
                  f"Megatron-LM picks by their depth)" for name, what in (("window_attn_skip_freq", "window"),
                                                                         ("no_rope_freq", "rotary embedding"))
                  if _arg(args, name) is not None]
    return found


def _position_embedding_type(args) -> str:
    if _arg(args, "use_rotary_position_embeddings"):  # before --position-embedding-type existed
        return "rope"
    return _arg(args, "position_embedding_type", "learned_absolute")


# Megatron-LM's mixture-of-experts args that are ours by the same name (ours follow Megatron's flags); a None
# in args is Megatron's "not set", which is our default too.
_MOE_ARGS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
             "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
             "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
             "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
             "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate")


def _moe_fields(args) -> dict:
    """Our mixture-of-experts fields of ``args`` ({} for a dense model)."""
    if not _arg(args, "num_experts"):
        return {}
    fields = {name: _arg(args, name) for name in _MOE_ARGS if _arg(args, name) is not None}
    freq = _arg(args, "moe_layer_freq", 1)  # an int, or the list Megatron's parser made of "([1]*3+[0])" etc.
    return dict(fields, num_experts=args.num_experts,
                moe_layer_freq=str(freq) if isinstance(freq, int) else str(list(freq)))


def model_config_from_megatron_args(args, source: str) -> ModelConfig:
    """Our ModelConfig for the model Megatron's ``args`` describe."""
    refuse_unsupported(args, source)
    heads = args.num_attention_heads
    epsilon = _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        num_query_groups=args.num_query_groups if _arg(args, "group_query_attention") else heads,
        kv_channels=_arg(args, "kv_channels") or args.hidden_size // heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=_arg(args, UNPADDED_VOCAB_SIZE_ARG) or args.padded_vocab_size,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        normalization=_arg(args, "normalization", "LayerNorm"), norm_epsilon=epsilon,
        apply_layernorm_1p=bool(_arg(args, "apply_layernorm_1p", False)),
        position_embedding_type=_position_embedding_type(args), rotary_base=float(_arg(args, "rotary_base", 10000)),
        rotary_percent=float(_arg(args, "rotary_percent", 1.0)),
        no_rope_freq=None if _arg(args, "no_rope_freq") is None else str(args.no_rope_freq),  # N or its list
        add_bias_linear=bool(_arg(args, "add_bias_linear", True)),
        # Megatron-LM's validation sets add_qkv_bias with add_bias_linear; ours is the QKV's bias alone (Qwen2).
        add_qkv_bias=bool(_arg(args, "add_qkv_bias")) and not _arg(args, "add_bias_linear", True),
        untie_embeddings_and_output_weights=bool(_arg(args, "untie_embeddings_and_output_weights", False)),
        hidden_dropout=_arg(args, "hidden_dropout", 0.1), attention_dropout=_arg(args, "attention_dropout", 0.1),
        init_method_std=_arg(args, "init_method_std", 0.02),
        use_rope_scaling=bool(_arg(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(_arg(args, "rope_scaling_factor", 8.0)),
        make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", 128),
        hf_model_type=_arg(args, HF_MODEL_TYPE_ARG), **_attention_fields(args), **_mlp_fields(args),
        **_yarn_fields(args), **_moe_fields(args), **_mtp_fields(args))


def _attention_fields(args) -> dict:
    """Our attention fields of ``args``: QK layer norms, gated attention, sinks, the sliding window."""
    window = _arg(args, "window_size")
    return dict(qk_layernorm=bool(_arg(args, "qk_layernorm")),
                attention_output_gate=bool(_arg(args, "attention_output_gate")),
                softmax_type=_arg(args, "softmax_type") or "vanilla",
                window_size=None if window is None else list(window),
                window_attn_skip_freq=_arg(args, "window_attn_skip_freq"))


def _mlp_fields(args) -> dict:
    """Our MLP fields of ``args``. Megatron-LM's --quick-geglu is a gated unit without --swiglu (which picks
    SiLU); ours is --swiglu's gate changed. Its GeLU is the erf one without ``bias_gelu_fusion``."""
    quick_geglu = bool(_arg(args, "quick_geglu"))
    gated = bool(_arg(args, "swiglu")) or quick_geglu
    return dict(swiglu=gated, quick_geglu=quick_geglu, glu_linear_offset=float(_arg(args, "glu_linear_offset") or 0.0),
                activation_func_clamp_value=_arg(args, "activation_func_clamp_value"),
                gelu_exact=not gated and not _arg(args, "bias_gelu_fusion", True))


# YaRN's args (--position-embedding-type yarn, Megatron-LM's names are ours), None where a flag was not given.
_YARN_ARGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
              "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int")


def _yarn_fields(args) -> dict:
    if _position_embedding_type(args) != "yarn":
        return {}
    return {name: _arg(args, name) for name in _YARN_ARGS if _arg(args, name) is not None}


def _mtp_fields(args) -> dict:
    """Our multi-token prediction fields of ``args`` ({} without its layers)."""
    if not _arg(args, "mtp_num_layers"):
        return {}
    scaling = _arg(args, "mtp_loss_scaling_factor")
    return dict(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=0.1 if scaling is None else scaling)


def config_from_megatron_args(args, source: str) -> Config:
    """Our Config for the checkpoint Megatron's ``args`` describe: the model, and the precision its weights
    were trained in (``--bf16``/``--fp16``), which an import keeps and an export writes again."""
    return Config(model=model_config_from_megatron_args(args, source),
                  training=TrainingConfig(bf16=bool(_arg(args, "bf16", False)), fp16=bool(_arg(args, "fp16", False))))


# Not Megatron-LM's: the Hugging Face family the model was imported as (``hf_model_type``), so that a model
# exported to Megatron-LM and imported back exports to Hugging Face as that family again (Megatron-LM keeps
# args it does not know and reads none of them).
HF_MODEL_TYPE_ARG = "hf_model_type"
# Not Megatron-LM's either: the vocabulary of a model we exported before Megatron-LM's padding (its
# ``orig_vocab_size``), so that its import cuts the padding rows we added, and a Hugging Face model taken to
# Megatron-LM and back has its own vocabulary again.
UNPADDED_VOCAB_SIZE_ARG = "unpadded_vocab_size"


def _moe_args(model: ModelConfig, expert_model_parallel_size: int) -> dict:
    """Megatron-LM's mixture-of-experts args for ``model`` (num_experts None for a dense one)."""
    if model.num_experts is None:
        return dict(num_experts=None)
    freq = parse_moe_layer_freq(model.moe_layer_freq)
    return dict({name: getattr(model, name) for name in _MOE_ARGS}, num_experts=model.num_experts,
                moe_layer_freq=freq, expert_model_parallel_size=expert_model_parallel_size,
                # Megatron-Core splits experts with biases over no tensor ranks (it asserts so); others like the
                # dense layers (None: the tensor size).
                expert_tensor_parallel_size=1 if model.add_bias_linear else None, moe_grouped_gemm=False,
                # The dispatcher changes no result; allgather needs no CUDA stream, so Megatron runs it on a CPU too.
                moe_token_dispatcher_type="allgather")


def megatron_args_from_config(config: Config, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                              iteration: int, source: str, ckpt_format: str = "torch",
                              expert_model_parallel_size: int = 1) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves, for our ``config`` at the given layout: the architecture args its
    ``--use-checkpoint-args`` rebuilds the model from, and those ``check_checkpoint_args`` compares.

    The inverse of ``model_config_from_megatron_args``, and checked by it: a model whose args do
    not map back to the same ModelConfig is one Megatron-LM cannot rebuild, refused by field.
    """
    model = config.model
    padded_vocab = model.padded_vocab_size(tensor_model_parallel_size)
    gqa = model.num_query_groups != model.num_attention_heads  # Megatron's parser leaves 1 groups without GQA
    args = argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, group_query_attention=gqa,
        num_query_groups=model.num_query_groups if gqa else 1,
        kv_channels=model.kv_channels or model.hidden_size // model.num_attention_heads,
        seq_length=model.seq_length, encoder_seq_length=model.seq_length,
        max_position_embeddings=model.max_position_embeddings, position_embedding_type=model.position_embedding_type,
        add_position_embedding=True,  # as Megatron-LM's parser leaves it: the deprecated flag's, which --position-
        # embedding-type replaced (its validation refuses it off with a type other than rope)
        use_rotary_position_embeddings=False, rotary_base=int(model.rotary_base), rotary_percent=model.rotary_percent,
        rotary_interleaved=False, no_rope_freq=None if model.no_rope_freq is None else parse_moe_layer_freq(
            model.no_rope_freq, "--no-rope-freq", "layers without rotary embeddings"),
        rotary_seq_len_interpolation_factor=model.rotary_seq_len_interpolation_factor,
        use_rope_scaling=model.use_rope_scaling, rope_scaling_factor=model.rope_scaling_factor,
        **_yarn_args(model), normalization=model.normalization, norm_epsilon=model.norm_epsilon,
        layernorm_epsilon=model.norm_epsilon, apply_layernorm_1p=model.apply_layernorm_1p, **_mlp_args(model),
        add_bias_linear=model.add_bias_linear, add_qkv_bias=model.add_qkv_bias or model.add_bias_linear,
        qk_layernorm=model.qk_layernorm, attention_output_gate=model.attention_output_gate,
        softmax_type=model.softmax_type, window_size=None if model.window_size is None else tuple(model.window_size),
        window_attn_skip_freq=model.window_attn_skip_freq,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        apply_query_key_layer_scaling=False, apply_residual_connection_post_layernorm=False,
        hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        vocab_size=model.vocab_size, padded_vocab_size=padded_vocab, tokenizer_type=config.data.tokenizer_type,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        transformer_pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        bf16=config.training.bf16, fp16=config.training.fp16, params_dtype=config.params_dtype,
        **_moe_args(model, expert_model_parallel_size), mtp_num_layers=model.mtp_num_layers,
        mtp_loss_scaling_factor=model.mtp_loss_scaling_factor, use_legacy_models=False,
        transformer_impl="local",
        ckpt_format=ckpt_format, iteration=iteration, consumed_train_samples=0, consumed_valid_samples=0,
        **{UNPADDED_VOCAB_SIZE_ARG: model.vocab_size},
        **({HF_MODEL_TYPE_ARG: model.hf_model_type} if model.hf_model_type else {}))
    _check_round_trip(args, model, source)
    return args


def _mlp_args(model: ModelConfig) -> dict:
    """Megatron-LM's MLP args for ``model``: --quick-geglu without --swiglu; the tanh GeLU's fusion flag; the
    SwiGLU's fusion off where the offset or clamp must apply (its fused kernel leaves them out)."""
    glu_extras = model.glu_linear_offset != 0.0 or model.activation_func_clamp_value is not None
    return dict(swiglu=model.swiglu and not model.quick_geglu, quick_geglu=model.quick_geglu, squared_relu=False,
                openai_gelu=False, bias_gelu_fusion=not model.swiglu and not model.gelu_exact,
                bias_swiglu_fusion=not glu_extras, glu_linear_offset=model.glu_linear_offset,
                activation_func_clamp_value=model.activation_func_clamp_value)


def _yarn_args(model: ModelConfig) -> dict:
    return {name: getattr(model, name) for name in _YARN_ARGS} if model.position_embedding_type == "yarn" else {}


def _check_round_trip(args, model: ModelConfig, source: str) -> None:
    """Every setting that changes what the weights compute comes back from ``args``; the others (how a run trains:
    an imported model's pad token) need not."""
    unmapped = unsupported_settings(args)
    if unmapped:
        raise ConfigError(f"{source} cannot be written as a Megatron-LM checkpoint: megatron_lite maps no Megatron-LM "
                          f"checkpoint with {', '.join(unmapped)}.")
    back = model_config_from_megatron_args(args, source)
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if defines_function(f.name, model) and getattr(back, f.name) != getattr(model, f.name)]
    if differ:
        raise ConfigError(f"{source} cannot be written as a Megatron-LM checkpoint: its model settings "
                          f"{', '.join('--' + name.replace('_', '-') for name in differ)} have no Megatron-LM args "
                          f"that megatron_lite maps back.")
