"""Which model settings a checkpoint's weights depend on: the load-time check and ``--use-checkpoint-args``.

Weights alone do not pin a model down. RMSNorm's epsilon or the rotary base change
every logit without changing the shape of a single weight, so a checkpoint loaded
into a model that differs in them trains a different model, silently (measured: an
imported Llama fine-tuned without ``--norm-epsilon 1e-6`` starts 1e-5 relative off
transformers' loss and drifts). So every ModelConfig field is classified once, in
``ROLES``, and every field that changes what the weights compute must match the
checkpoint. A field missing from ``ROLES`` counts as architecture: a wrong "checked"
costs an error message, a wrong "not checked" a silently different model.

``--use-checkpoint-args`` (Megatron-LM's flag, ``load_args_from_checkpoint``) takes
the model from the checkpoint instead, so a fine-tuning run needs only training flags.
"""
from __future__ import annotations

import dataclasses
import enum

from megatron_lite.config import ConfigError, ModelConfig, flag_is_on, flag_name


class Role(enum.Enum):
    """What a ModelConfig field is to a checkpoint."""

    ARCHITECTURE = "changes what the weights compute: must match the checkpoint"
    TRAINING = "how this run trains the model: free to differ; --use-checkpoint-args takes it unless given"
    MACHINE = "how this machine computes the same function: never taken from a checkpoint"


ROLES = {
    "num_layers": Role.ARCHITECTURE,
    "hidden_size": Role.ARCHITECTURE,
    "num_attention_heads": Role.ARCHITECTURE,
    "num_query_groups": Role.ARCHITECTURE,
    "ffn_hidden_size": Role.ARCHITECTURE,
    "kv_channels": Role.ARCHITECTURE,
    "vocab_size": Role.ARCHITECTURE,  # the logits' width; the tokenizer must fit in it
    "max_position_embeddings": Role.ARCHITECTURE,  # with learned positions only, see _ONLY_WITH
    "normalization": Role.ARCHITECTURE,
    "norm_epsilon": Role.ARCHITECTURE,
    "apply_layernorm_1p": Role.ARCHITECTURE,  # the same stored weights scale by w or by 1 + w
    "position_embedding_type": Role.ARCHITECTURE,
    "rotary_base": Role.ARCHITECTURE,  # with rope only, see _ONLY_WITH
    "rotary_base_local": Role.ARCHITECTURE,
    "rotary_percent": Role.ARCHITECTURE,  # with rope only
    "no_rope_freq": Role.ARCHITECTURE,
    # Llama 4's attention: chunked layers, q/k L2 norms, the NoPE layers' temperature
    "attention_chunk_size": Role.ARCHITECTURE,
    "qk_l2_norm": Role.ARCHITECTURE,
    "attn_temperature_tuning": Role.ARCHITECTURE,
    "attn_temperature_floor_scale": Role.ARCHITECTURE,  # with the tuning only, see _ONLY_WITH
    "attn_temperature_scale": Role.ARCHITECTURE,
    "swiglu": Role.ARCHITECTURE,
    "add_bias_linear": Role.ARCHITECTURE,
    "untie_embeddings_and_output_weights": Role.ARCHITECTURE,
    "add_qkv_bias": Role.ARCHITECTURE,
    "qk_layernorm": Role.ARCHITECTURE,
    "qk_layernorm_whole_projection": Role.ARCHITECTURE,
    "window_size": Role.ARCHITECTURE,
    "window_attn_skip_freq": Role.ARCHITECTURE,
    "softmax_scale": Role.ARCHITECTURE,
    "attn_logit_softcapping": Role.ARCHITECTURE,
    "final_logit_softcapping": Role.ARCHITECTURE,
    "post_sublayer_norm": Role.ARCHITECTURE,
    "no_pre_sublayer_norm": Role.ARCHITECTURE,
    "parallel_attention_mlp": Role.ARCHITECTURE,
    "scale_embeddings": Role.ARCHITECTURE,
    "geglu": Role.ARCHITECTURE,
    "gelu_exact": Role.ARCHITECTURE,  # with a GELU only (no SwiGLU), see _ONLY_WITH
    # gpt-oss's sinks and gated unit (the last three with --swiglu only)
    "softmax_type": Role.ARCHITECTURE,
    "quick_geglu": Role.ARCHITECTURE,
    "glu_linear_offset": Role.ARCHITECTURE,
    "activation_func_clamp_value": Role.ARCHITECTURE,
    "rotary_seq_len_interpolation_factor": Role.ARCHITECTURE,  # with rope only
    "use_rope_scaling": Role.ARCHITECTURE,  # with rope only
    "rope_scaling_factor": Role.ARCHITECTURE,  # with --use-rope-scaling only
    "rope_scaling_low_freq_factor": Role.ARCHITECTURE,
    "rope_scaling_high_freq_factor": Role.ARCHITECTURE,
    # YaRN's, with YaRN only
    "rotary_scaling_factor": Role.ARCHITECTURE,
    "mscale": Role.ARCHITECTURE,
    "mscale_all_dim": Role.ARCHITECTURE,
    "yarn_original_max_position_embeddings": Role.ARCHITECTURE,
    "yarn_beta_fast": Role.ARCHITECTURE,
    "yarn_beta_slow": Role.ARCHITECTURE,
    "yarn_correction_range_round_to_int": Role.ARCHITECTURE,
    # multi-latent attention's, with it only (kv_channels sizes nothing there)
    "multi_latent_attention": Role.ARCHITECTURE,
    "q_lora_rank": Role.ARCHITECTURE,
    "kv_lora_rank": Role.ARCHITECTURE,
    "qk_head_dim": Role.ARCHITECTURE,
    "qk_pos_emb_head_dim": Role.ARCHITECTURE,
    "v_head_dim": Role.ARCHITECTURE,
    "rope_type": Role.ARCHITECTURE,
    "num_experts": Role.ARCHITECTURE,
    "moe_ffn_hidden_size": Role.ARCHITECTURE,
    "moe_layer_freq": Role.ARCHITECTURE,
    "moe_router_topk": Role.ARCHITECTURE,
    "moe_router_score_function": Role.ARCHITECTURE,
    "moe_router_pre_softmax": Role.ARCHITECTURE,
    "moe_router_topk_scaling_factor": Role.ARCHITECTURE,
    "moe_router_num_groups": Role.ARCHITECTURE,
    "moe_router_group_topk": Role.ARCHITECTURE,
    "moe_router_group_score": Role.ARCHITECTURE,
    "moe_router_enable_expert_bias": Role.ARCHITECTURE,  # the bias is stored with the weights and routes
    "moe_shared_expert_intermediate_size": Role.ARCHITECTURE,
    "moe_shared_expert_gate": Role.ARCHITECTURE,
    "moe_apply_probs_on_input": Role.ARCHITECTURE,
    # Dropping tokens past capacity changes the output in evaluation too, as in Megatron-LM.
    "moe_expert_capacity_factor": Role.ARCHITECTURE,
    "moe_pad_expert_input_to_capacity": Role.ARCHITECTURE,
    "moe_token_drop_policy": Role.ARCHITECTURE,
    # How the router is trained: its losses and the expert bias's step.
    "moe_router_load_balancing_type": Role.TRAINING,
    "moe_aux_loss_coeff": Role.TRAINING,
    "moe_z_loss_coeff": Role.TRAINING,
    "moe_router_bias_update_rate": Role.TRAINING,
    "moe_grouped_gemm": Role.MACHINE,  # the same experts, multiplied in one grouped GEMM
    # Multi-token prediction: its layers are weights of the checkpoint; their loss's weight is how a run trains.
    "mtp_num_layers": Role.ARCHITECTURE,
    "mtp_loss_scaling_factor": Role.TRAINING,
    # Gated attention and gated DeltaNet layers (Qwen3-Next): which layers mix tokens how, and their sizes.
    "attention_output_gate": Role.ARCHITECTURE,
    "experimental_attention_variant": Role.ARCHITECTURE,
    **{name: Role.ARCHITECTURE for name in ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                                            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")},
    # Positions are bounded by max_position_embeddings; seq_length is only how long the samples are.
    "seq_length": Role.TRAINING,
    "hidden_dropout": Role.TRAINING,
    "attention_dropout": Role.TRAINING,
    "init_method_std": Role.TRAINING,  # the loaded weights replace the initial ones
    # Which embedding row trains; an imported model's pad token comes with --use-checkpoint-args.
    "pad_token_id": Role.TRAINING,
    "freeze_padding_embedding": Role.TRAINING,
    # Padding rows are outside the logits and the loss, and loading resizes them to this run's padding.
    "make_vocab_size_divisible_by": Role.TRAINING,
    "hf_model_type": Role.TRAINING,  # how the model is exported, not what it computes
    "use_fused_kernels": Role.MACHINE,
    "attention_backend": Role.MACHINE,  # SDPA or the unfused path: the same attention, rounded differently
}

# Architecture in some models only: the position table exists with learned positions, the rotary base
# matters with rotary ones, and so on. (field, whether it matters in a model)
_ROTARY = lambda model: model.rotary  # noqa: E731
_LATENT = lambda model: model.multi_latent_attention  # noqa: E731
_YARN = lambda model: model.yarn  # noqa: E731
_EXPERTS = lambda model: model.num_experts is not None  # noqa: E731
_ONLY_WITH = {"max_position_embeddings": lambda model: model.position_embedding_type == "learned_absolute",
              "rotary_base": _ROTARY, "rotary_percent": _ROTARY, "rotary_seq_len_interpolation_factor": _ROTARY,
              "use_rope_scaling": _ROTARY, "no_rope_freq": _ROTARY,
              **{name: lambda model: model.use_rope_scaling
                 for name in ("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor")},
              **{name: lambda model: model.attn_temperature_tuning
                 for name in ("attn_temperature_floor_scale", "attn_temperature_scale")},
              "kv_channels": lambda model: not model.multi_latent_attention,
              "gelu_exact": lambda model: not model.swiglu or model.geglu,
              **{name: lambda model: model.swiglu for name in ("quick_geglu", "glu_linear_offset",
                                                               "activation_func_clamp_value")},
              **{name: _YARN for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim",
                                          "yarn_original_max_position_embeddings", "yarn_beta_fast",
                                          "yarn_beta_slow", "yarn_correction_range_round_to_int")},
              **{name: _LATENT for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                            "v_head_dim", "rope_type")},
              # The gated DeltaNet's sizes, in a model with such layers only.
              **{name: lambda model: model.experimental_attention_variant is not None
                 for name in ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")},
              # Every expert and router setting, the router's training ones too: a dense model has none.
              **{name: _EXPERTS for name in ROLES if name.startswith("moe_")},
              "moe_router_group_score": lambda model: _EXPERTS(model) and model.moe_router_num_groups is not None,
              "moe_router_bias_update_rate": lambda model: _EXPERTS(model) and model.moe_router_enable_expert_bias,
              "mtp_loss_scaling_factor": lambda model: model.mtp_num_layers is not None,
              **{name: lambda model: _EXPERTS(model) and model.moe_expert_capacity_factor is not None
                 for name in ("moe_pad_expert_input_to_capacity", "moe_token_drop_policy")}}


def role(field: str) -> Role:
    return ROLES.get(field, Role.ARCHITECTURE)


def describes(field: str, model: ModelConfig) -> bool:
    """Whether ``field`` means anything for ``model`` (a YaRN factor does not without YaRN, nor a router
    setting without experts)."""
    return field not in _ONLY_WITH or _ONLY_WITH[field](model)


def defines_function(field: str, model: ModelConfig) -> bool:
    """Whether ``field`` changes what ``model``'s weights compute."""
    return role(field) is Role.ARCHITECTURE and describes(field, model)


def _shown(field: str, value) -> str:
    """A value as the user sets it: booleans as whether their flag is on."""
    if isinstance(value, bool):
        return "on" if flag_is_on(field, value) else "off"
    return str(value)


def _difference(field: str, checkpoint_value, run_value) -> str:
    return f"  {flag_name(field)}: checkpoint {_shown(field, checkpoint_value)}, this run {_shown(field, run_value)}"


def check_architecture(saved_model: dict, model: ModelConfig, checkpoint: str) -> None:
    """Raise one ConfigError listing every setting in which ``model`` computes something else than the
    checkpoint's model (``saved_model``, the ``model`` section of its metadata)."""
    saved = saved_model_config(saved_model, checkpoint)
    differences = [_difference(f.name, getattr(saved, f.name), getattr(model, f.name))
                   for f in dataclasses.fields(ModelConfig)
                   if defines_function(f.name, saved) and getattr(saved, f.name) != getattr(model, f.name)]
    if differences:
        raise ConfigError(
            f"this run's model differs from the checkpoint's ({checkpoint}) in {len(differences)} setting(s) "
            f"that change what its weights compute:\n" + "\n".join(differences) +
            "\nSet these flags to the checkpoint's values, or add --use-checkpoint-args to take the model "
            "from the checkpoint.")


def saved_model_config(saved_model: dict, checkpoint: str) -> ModelConfig:
    """The checkpoint's ModelConfig; a field it predates gets its default, which is what computed it."""
    unknown = sorted(set(saved_model) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ConfigError(f"the checkpoint {checkpoint} was written with model settings this megatron_lite does "
                          f"not know ({', '.join(unknown)}): it needs a newer megatron_lite.")
    return ModelConfig(**saved_model)


def model_args_from_checkpoint(given: dict, saved: ModelConfig, checkpoint: str) -> dict:
    """The model fields of a ``--use-checkpoint-args`` run that the command line (``given``) leaves out.

    As Megatron-LM's ``load_args_from_checkpoint``: every model setting comes from the
    checkpoint, except machine settings (``--no-fused-kernels``) and what the command line
    gives. Unlike Megatron-LM, a given flag that changes what the weights compute must
    agree with the checkpoint (one error lists those that do not) rather than being
    silently replaced; training settings given (``--seq-length``, dropouts) win.
    """
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    conflicts = [_difference(name, getattr(saved, name), given[name]) for name in fields
                 if name in given and defines_function(name, saved) and given[name] != getattr(saved, name)]
    if conflicts:
        raise ConfigError(
            f"--use-checkpoint-args takes the model from the checkpoint in {checkpoint}, but these flags "
            f"contradict it:\n" + "\n".join(conflicts) + "\nDrop them: the checkpoint's values apply.")
    return {name: getattr(saved, name) for name in fields if name not in given and role(name) is not Role.MACHINE}
