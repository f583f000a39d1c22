"""Our flag defaults pinned against Megatron-LM's, so a Megatron script that omits a flag trains the same here.

MEGATRON_DEFAULTS was read off Megatron-LM commit d98e8a6 by running its own parser
(``add_megatron_arguments``, then ``validate_args`` for the derived ones) on a flag-less command
line, outside this repository. Where Megatron's "unset" is None and ours is an empty list or False
with the same meaning, the table holds ours. DELIBERATE lists the differences we keep, each
named in the flag's --help. Every flag our parser accepts must be in one of the three tables,
so a new flag cannot arrive unclassified and a changed default fails here.
"""
import dataclasses

import pytest

from megatron_lite.config import SECTIONS, default_ffn_hidden_size
from megatron_lite.cli.arguments import build_parser, parse_args
from megatron_lite.config.help_text import HELP

MEGATRON_COMMIT = "d98e8a64dd"

MEGATRON_DEFAULTS = {
    # model (the required sizes have no default in either)
    "ffn_hidden_size": None, "kv_channels": None, "normalization": "LayerNorm", "norm_epsilon": 1e-5,
    "apply_layernorm_1p": False, "window_attn_skip_freq": None, "position_embedding_type": "learned_absolute",
    "rotary_base": 10000.0,
    "rotary_percent": 1.0, "no_rope_freq": None, "attention_backend": "auto", "swiglu": False, "add_bias_linear": True,
    "untie_embeddings_and_output_weights": False, "add_qkv_bias": False, "qk_layernorm": False,
    "window_size": None, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "init_method_std": 0.02, "make_vocab_size_divisible_by": 128,
    # gpt-oss's: TransformerConfig's softmax_type, glu_linear_offset, activation_func_clamp_value; --quick-geglu
    "softmax_type": "vanilla", "quick_geglu": False, "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
    "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rope_type": None, "rotary_scaling_factor": 1.0, "mscale": 1.0,
    "mscale_all_dim": 0.0, "yarn_original_max_position_embeddings": None, "yarn_beta_fast": None,
    "yarn_beta_slow": None,
    # Megatron's None (unset) rounds, as our True does.
    "yarn_correction_range_round_to_int": True,
    # Megatron's num_query_groups default (1) is read only with --group-query-attention; without it
    # both use one group per head.
    "num_query_groups": None,
    # mixture of experts (TransformerConfig's fields, which Megatron-LM's parser takes its --moe-* flags from)
    "num_experts": None, "moe_ffn_hidden_size": None, "moe_router_topk": 2, "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None, "moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 1e-3,
    "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False, "moe_token_drop_policy": "probs",
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False, "moe_grouped_gemm": False,
    "moe_apply_probs_on_input": False, "qk_l2_norm": False,  # TransformerConfig's (Llama 4's)
    # multi-token prediction (TransformerConfig's)
    "mtp_num_layers": None, "mtp_loss_scaling_factor": 0.1,
    # Gated attention and gated DeltaNet (read off Megatron-LM's TransformerConfig at a later commit, which added them)
    "attention_output_gate": False, "experimental_attention_variant": None, "linear_attention_freq": None,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    # parallel
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    # Megatron-LM's --cp-comm-type is a list too (one value for every layer, or one per layer).
    "cp_comm_type": ["p2p"],
    "num_layers_per_virtual_pipeline_stage": None, "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None, "sequence_parallel": False, "use_distributed_optimizer": False,
    "overlap_grad_reduce": False, "overlap_param_gather": False, "ddp_bucket_size": None,
    "accumulate_allreduce_grads_in_fp32": False, "grad_reduce_in_bf16": False, "distributed_timeout_minutes": 10,
    # training
    "global_batch_size": None, "train_iters": None, "train_samples": None, "rampup_batch_size": None,
    "step_batch_size_schedule": None, "calculate_per_token_loss": False, "seed": 1234, "bf16": False,
    "fp16": False, "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
    "eval_iters": 100, "exit_signal_handler": False, "exit_interval": None, "exit_duration_in_mins": None,
    "check_weight_hash_across_dp_replicas_interval": None, "manual_gc": False, "manual_gc_interval": 0,
    "manual_gc_eval": True, "empty_unused_memory_level": 0, "check_for_nan_in_loss_and_grad": True,
    # the re-run engine (RerunStateMachineConfig) and the straggler detector (StragglerDetectionConfig)
    "rerun_mode": "validate_results", "check_for_spiky_loss": False, "check_for_large_grads": False,
    "error_injection_rate": 0, "error_injection_type": "transient_error", "log_straggler": False,
    # optimizer
    "optimizer": "adam", "min_lr": 0.0, "lr_decay_style": "linear", "lr_wsd_decay_style": "exponential",
    "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None, "lr_warmup_init": 0.0, "lr_warmup_iters": 0,
    "lr_decay_iters": None,
    "lr_warmup_samples": 0, "lr_decay_samples": None, "lr_warmup_fraction": None, "decoupled_lr": None,
    "decoupled_min_lr": None, "weight_decay": 0.01, "start_weight_decay": None, "end_weight_decay": None,
    "weight_decay_incr_style": "constant", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
    "sgd_momentum": 0.9,
    # --optimizer muon and lion (read off Megatron-LM's arguments.py at a later commit, which added them)
    "muon_momentum": 0.9, "muon_split_qkv": True, "muon_nesterov": False, "muon_scale_mode": "spectral",
    "muon_fp32_matmul_prec": "medium", "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
    "muon_tp_mode": "duplicated", "muon_extra_scale_factor": 1.0, "muon_scalar_optimizer": "adam",
    "lion_beta1": 0.95, "lion_beta2": 0.98,
    "clip_grad": 1.0, "loss_scale": None, "initial_loss_scale": 2.0 ** 32,
    "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2, "optimizer_cpu_offload": False,
    "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
    # data (Megatron's --split None becomes "969, 30, 1" in validate_args)
    "data_path": [], "split": "969,30,1", "mock_data": False, "tokenizer_type": None, "vocab_file": None,
    "merge_file": None, "tokenizer_model": None, "tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
    "data_cache_path": None, "mmap_bin_files": True, "eod_mask_loss": False, "sft": False,
    "train_data_path": [], "valid_data_path": [], "test_data_path": [],
    # checkpoint
    "save": None, "load": None, "save_interval": None, "no_load_optim": False, "no_load_rng": False,
    "finetune": False, "pretrained_checkpoint": None, "use_checkpoint_args": False,
    "async_save": False,  # Megatron-LM: store_true with default None, the same off
    # logging
    "log_interval": 100, "tensorboard_dir": None, "wandb_project": "", "wandb_exp_name": "", "wandb_save_dir": "",
    "wandb_entity": "", "log_throughput": False, "profile": False,
    "profile_step_start": 10, "profile_step_end": 12, "profile_ranks": [],
}

# field: (Megatron-LM's default, ours). The reason is in each flag's --help.
DELIBERATE = {
    "lr": (None, 3e-4),  # Megatron requires --lr; ours lets a flag-less tiny run start
    "micro_batch_size": (None, 1),  # Megatron requires it
    "max_position_embeddings": (None, None),  # Megatron requires it; ours then takes --seq-length
    "eval_interval": (None, 1000),  # Megatron's None fails in its validation sample count; 1000 was its default
    "num_workers": (2, 0),  # same samples in the same order; no worker processes on small runs
    "sft_tokenizer_prompt_format": ("nemotron-h-aligned", "plain"),  # we have no nemotron-h-aligned format
    "distributed_backend": ("nccl", None),  # None: nccl with CUDA, gloo on CPU
    "data_parallel_sharding_strategy": ("optim_grads_params", None),  # Megatron's applies to --use-megatron-fsdp only
    "moe_layer_freq": (1, "1"),  # the flag's text, parsed when used: Megatron-LM keeps an int or an eval'd list
    "expert_tensor_parallel_size": (1, None),  # None: the tensor-parallel size, which validate_args writes in
}

NOT_IN_MEGATRON = {"use_fused_kernels", "virtual_pipeline_model_parallel_size", "grad_cpu_offload",
                   "sft_pack_sequences", "peak_tflops", "log_memory", "peft", "lora_rank", "lora_alpha",
                   "lora_dropout", "lora_target_modules", "adapter_dim", "prefix_length",
                   "prefix_projection_hidden_size", "sft_format", "sft_data_keys", "peft_without_base_checkpoint",
                   "lr_warmup_style", "train_epochs",  # HF Trainer's num_train_epochs: Megatron-LM has no epochs
                   "softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",  # Gemma 2's
                   "post_sublayer_norm", "scale_embeddings", "geglu",
                   "no_pre_sublayer_norm",  # OLMo 2's reordered norms: Megatron-Core builds them from a layer spec
                   "qk_layernorm_whole_projection",  # OLMoE's q/k norms; Megatron-Bridge has them, Megatron-LM not
                   "moe_router_group_score",  # DeepSeek-V2's group max beside Megatron-LM's top-k sum
                   "rotary_base_local",  # Gemma 3's local layers; Megatron-Bridge's field, no Megatron-LM flag
                   "parallel_attention_mlp",  # GPT-NeoX's parallel residual; Transformer Engine's name
                   # Llama 4's chunked attention, NoPE temperature and Scout's RoPE frequency factors (Megatron-LM
                   # fixes them at 1 and 4)
                   "attention_chunk_size", "attn_temperature_tuning", "attn_temperature_floor_scale",
                   "attn_temperature_scale", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                   "hf_model_type",  # the Hugging Face family an export names
                   "dpo", "dpo_beta", "dpo_loss_type", "dpo_label_smoothing",  # Megatron-LM has no DPO (NeMo-RL does)
                   "dpo_simpo_gamma", "dpo_cpo_alpha", "dpo_precompute_ref_log_probs",
                   # nor GRPO: TRL's GRPOConfig names, and the generate command's sampling flags
                   "grpo", "reward_function", "reward_weights", "grpo_group_size", "max_new_tokens", "temperature",
                   "top_p", "grpo_epsilon", "grpo_epsilon_high", "grpo_beta", "grpo_iterations", "grpo_loss_type",
                   "grpo_scale_rewards", "grpo_log_completions",
                   "gelu_exact",  # Megatron-LM's spelling is --no-bias-gelu-fusion, which sets it here too
                   "pad_token_id", "freeze_padding_embedding",  # transformers' padding_idx, on request
                   "deepspeed_config", "deepspeed"}  # the DeepSpeed config's spellings, translated at parse time
REQUIRED = {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"}  # in both

FIELDS = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def _our_default(name):
    field = FIELDS[name]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def test_every_flag_is_classified():
    dests = {action.dest for action in build_parser()._actions
             if action.option_strings and action.dest != "help" and not action.dest.startswith("megatron_only_")}
    dests.discard("group_query_attention")  # a switch with no field; off in both
    tables = set(MEGATRON_DEFAULTS) | set(DELIBERATE) | NOT_IN_MEGATRON | REQUIRED
    assert dests - tables == set(), "classify these flags' defaults against Megatron-LM"
    assert tables - dests == set()


@pytest.mark.parametrize("name", sorted(MEGATRON_DEFAULTS))
def test_default_matches_megatron(name):
    assert _our_default(name) == MEGATRON_DEFAULTS[name], f"--{name} drifted from Megatron-LM {MEGATRON_COMMIT}"


@pytest.mark.parametrize("name", sorted(DELIBERATE))
def test_deliberate_difference_is_kept_and_documented(name):
    megatron, ours = DELIBERATE[name]
    assert _our_default(name) == ours
    assert "Megatron-LM" in HELP[name], f"--{name}'s help must say how it differs from Megatron-LM"


# Megatron-LM's validate_args at d98e8a6 with --swiglu and no --ffn-hidden-size (run outside this repo).
MEGATRON_SWIGLU_FFN = {64: 128, 96: 256, 768: 2048, 4096: 10880, 5120: 13632, 8192: 21824}


@pytest.mark.parametrize("hidden", sorted(MEGATRON_SWIGLU_FFN))
def test_swiglu_ffn_hidden_size_default_is_megatrons(hidden):
    assert default_ffn_hidden_size(hidden, swiglu=True) == MEGATRON_SWIGLU_FFN[hidden]
    assert default_ffn_hidden_size(hidden, swiglu=False) == 4 * hidden
    config = parse_args(["--num-layers", "1", "--hidden-size", str(hidden), "--num-attention-heads", "8",
                         "--seq-length", "8", "--vocab-size", "64", "--mock-data", "--swiglu"])
    assert config.model.ffn_hidden_size == MEGATRON_SWIGLU_FFN[hidden]


def test_flagless_run_gets_megatrons_schedule():
    config = parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
                         "--vocab-size", "64", "--mock-data", "--train-iters", "7"])
    assert config.optimizer.lr_decay_style == "linear"
    assert config.optimizer.lr_decay_iters == 7  # Megatron: --lr-decay-iters defaults to --train-iters
    assert config.training.eval_iters == 100


def test_swiglu_default_width_of_zero_is_refused_by_name():
    from megatron_lite.config import ConfigError
    with pytest.raises(ConfigError, match="--ffn-hidden-size"):
        parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                    "--vocab-size", "64", "--mock-data", "--swiglu"])
