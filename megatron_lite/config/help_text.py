"""One line of ``--help`` per flag, by config field name.

Kept beside the dataclasses rather than in them so the config reads as a list of
fields; ``tests/test_config.py`` fails when a field has no line here. A flag's choices
are its field's ``choices`` metadata (``megatron_lite/cli/`` says how to add a flag).
"""

HELP = {
    # model
    "num_layers": "transformer layers",
    "hidden_size": "width of the residual stream",
    "num_attention_heads": "attention heads (query heads with --group-query-attention)",
    "seq_length": "tokens per training sequence",
    "vocab_size": ("vocabulary size, without padding; taken from the tokenizer when --tokenizer-type is given "
                   "(NullTokenizer: the model's ids, the last being EOD)"),
    "ffn_hidden_size": ("MLP inner width (default 4 x --hidden-size; with --swiglu 2/3 of that, rounded down to a "
                        "multiple of 64, as Megatron-LM)"),
    "num_query_groups": "key/value heads with --group-query-attention (default: one per attention head)",
    "max_position_embeddings": ("rows of the learned position table (default --seq-length; Megatron-LM requires "
                                "the flag)"),
    "kv_channels": "width of each attention head; query/key/value are heads x this wide (default hidden / heads)",
    "normalization": "norm before attention and MLP: LayerNorm (GPT-2) or RMSNorm (Llama)",
    "norm_epsilon": "epsilon inside the norms (Llama checkpoints often use 1e-6 or 1e-5)",
    "apply_layernorm_1p": "norm weights hold scale - 1, zero at init (Megatron's zero-centred gamma; both norms)",
    "position_embedding_type": "learned_absolute (GPT-2), rope (rotary, Llama) or yarn (rotary with YaRN scaling)",
    "rotary_base": "RoPE base frequency theta (Llama 3: 500000); with --rotary-base-local, the global layers' only",
    "rotary_base_local": ("RoPE base of the sliding-window (local) layers, which then rotate without RoPE scaling; "
                          "--rotary-base and the scaling are the global layers' (Gemma 3: 10000 and 1000000; "
                          "Megatron-Bridge's rotary_base_local, not a Megatron-LM flag)"),
    "rotary_percent": "fraction of each head's channels that RoPE rotates (the first ones; GPT-NeoX: 0.25)",
    "attention_backend": ("auto, flash, fused: torch's scaled_dot_product_attention; unfused, local: explicit "
                          "QK^T, the fused causal masked softmax, then V"),
    "swiglu": "SwiGLU MLP (gated SiLU, Llama) instead of GELU",
    "add_bias_linear": "drop the biases of every linear layer (Llama)",
    "add_qkv_bias": "a bias on the query/key/value projection only, also with --disable-bias-linear (Qwen2)",
    "qk_layernorm": ("normalise each head's queries and keys (RMSNorm over the head width) before RoPE (Qwen3); with "
                     "--multi-latent-attention, the query and key/value latents"),
    "qk_layernorm_whole_projection": ("with --qk-layernorm, normalise all heads' queries together (and all keys): "
                                      "one RMSNorm over the whole projection, a weight per channel (OLMoE; "
                                      "Megatron-Bridge's OLMoE attention, not a Megatron-LM flag)"),
    "window_size": ("sliding-window attention LEFT RIGHT, RIGHT 0: a token sees itself and the LEFT tokens "
                    "before it (Mistral's sliding_window W is LEFT = W - 1); default: the whole sequence"),
    "window_attn_skip_freq": ("with --window-size, every Nth layer (counting from 1) attends to the whole "
                              "sequence, the others to the window (Gemma 2: 2)"),
    "softmax_scale": ("scale of the attention scores (default 1/sqrt(--kv-channels); Gemma 2: "
                      "query_pre_attn_scalar^-0.5)"),
    "attn_logit_softcapping": ("cap the attention scores to cap * tanh(score / cap) before the mask and softmax "
                               "(Gemma 2; takes the explicit attention path, not SDPA)"),
    "final_logit_softcapping": "cap the output logits to cap * tanh(logit / cap) (Gemma 2)",
    "post_sublayer_norm": "normalise the attention and MLP outputs too, before they join the residual (Gemma 2)",
    "no_pre_sublayer_norm": ("with --post-sublayer-norm, no norm before attention and the MLP: each reads the "
                             "residual as it is, x + Norm(Attn(x)) (OLMo 2 and 3)"),
    "no_rope_freq": ("layers without rotary embeddings (NoPE): N (every Nth layer, counting from 1) or a list of "
                     "0s and 1s, 1 for a NoPE layer, e.g. \"([0]*3+[1])*2\" (SmolLM3's no_rope_layers, inverted)"),
    "attention_chunk_size": ("chunked local attention (Llama 4): on the layers with rotary embeddings a query sees "
                             "only the earlier keys of its own chunk of this many positions, counted from the "
                             "sequence's first (each packed example's, each prompt's); NoPE layers see everything"),
    "qk_l2_norm": ("divide each head's queries and keys by their root mean square, no weight (Llama 4's "
                   "use_qk_norm), on every layer but the NoPE ones (--no-rope-freq), which Megatron-LM normalises too"),
    "attn_temperature_tuning": ("Llama 4: the NoPE layers' queries times 1 + --attn-temperature-scale x "
                                "ln(1 + floor((position + 1) / --attn-temperature-floor-scale))"),
    "attn_temperature_floor_scale": "positions per step of --attn-temperature-tuning's temperature (Llama 4: 8192)",
    "attn_temperature_scale": "how much --attn-temperature-tuning's temperature grows per step (Llama 4: 0.1)",
    "mtp_num_layers": ("multi-token prediction layers on the last pipeline stage (DeepSeek-V3): depth k predicts "
                       "the token k + 1 after each position from the previous depth's hidden state and the next "
                       "token's embedding; trained only, never used to generate"),
    "mtp_loss_scaling_factor": ("the multi-token prediction loss's weight: factor / --mtp-num-layers times the sum "
                                "of the depths' mean cross entropies joins the language-model loss"),
    "attention_output_gate": ("gated attention (Qwen3-Next): the query projection also makes a gate per head "
                              "channel, and each head's output is multiplied by its sigmoid before the output "
                              "projection"),
    "experimental_attention_variant": ("gdn: gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) on the layers "
                                       "--linear-attention-freq picks, softmax attention on the others"),
    "linear_attention_freq": ("with --experimental-attention-variant gdn, which layers are linear attention: N "
                              "(every Nth layer, counting from 1, keeps softmax attention) or a list of 0s and 1s, "
                              "1 for a linear-attention layer"),
    "linear_conv_kernel_dim": "the gated DeltaNet's short causal depthwise convolution width (Qwen3-Next: 4)",
    "linear_key_head_dim": "the gated DeltaNet's query and key head width",
    "linear_value_head_dim": "the gated DeltaNet's value (and output gate) head width",
    "linear_num_key_heads": "the gated DeltaNet's query and key heads",
    "linear_num_value_heads": ("the gated DeltaNet's value heads, a multiple of --linear-num-key-heads (each "
                               "query/key head serves that many)"),
    "parallel_attention_mlp": ("attention and MLP side by side, both from the layer's input: x + Attn(Norm(x)) + "
                               "MLP(Norm(x)) (GPT-NeoX / Pythia's use_parallel_residual, GPT-J)"),
    "scale_embeddings": "multiply the word embeddings by sqrt(--hidden-size) (Gemma)",
    "geglu": "with --swiglu, gate with tanh GELU instead of SiLU (GeGLU, Gemma)",
    "softmax_type": ("attention softmax: vanilla, off-by-one (a sink logit 0 per head in the denominator) or "
                     "learnable (one learned sink logit per head, gpt-oss's sinks)"),
    "quick_geglu": "with --swiglu, gate with quick GELU x sigmoid(1.702 x) instead of SiLU (gpt-oss)",
    "glu_linear_offset": "with --swiglu, add this to the linear (up) half: gate x (up + offset) (gpt-oss: 1)",
    "activation_func_clamp_value": ("with --swiglu, clamp the gate to at most C and the linear half to [-C, C] "
                                    "before the gated unit (gpt-oss: 7)"),
    "gelu_exact": "the exact (erf) GELU instead of the tanh approximation (Megatron-LM without "
                  "--bias-gelu-fusion, GPT-2's activation_function gelu)",
    "rotary_seq_len_interpolation_factor": "linear RoPE scaling: positions are divided by this factor",
    "use_rope_scaling": ("Llama 3.x RoPE scaling: low frequencies divided by --rope-scaling-factor (original "
                         "context 8192, low/high frequency factors 1 and 4 unless given, as Megatron-LM)"),
    "rope_scaling_factor": "the factor of --use-rope-scaling",
    "rope_scaling_low_freq_factor": ("--use-rope-scaling's low frequency factor: wavelengths over the original "
                                     "context / this are divided by the factor (1, as Megatron-LM)"),
    "rope_scaling_high_freq_factor": ("--use-rope-scaling's high frequency factor: wavelengths under the original "
                                      "context / this keep their frequency, those between blend (4, as Megatron-LM; "
                                      "Llama 4 Scout: 1)"),
    "rotary_scaling_factor": "YaRN's context stretch: low frequencies divided by it, high ones kept",
    "mscale": ("YaRN: rotated channels scaled by (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) "
               "+ 1)"),
    "mscale_all_dim": ("YaRN: the denominator's mscale; multi-latent attention also multiplies its softmax scale by "
                       "(0.1 mscale_all_dim ln(factor) + 1)^2"),
    "yarn_original_max_position_embeddings": "YaRN: the context the model was trained at before the stretch "
                                             "(default 4096)",
    "yarn_beta_fast": "YaRN: frequencies of more than this many turns over the original context are kept (default 32)",
    "yarn_beta_slow": "YaRN: those of fewer turns are fully stretched, in between blended (default 1)",
    "yarn_correction_range_round_to_int": "YaRN: keep the blended range of channels unrounded (default: rounded out)",
    "multi_latent_attention": ("multi-latent attention (DeepSeek-V2/V3): queries, keys and values from low-rank "
                               "latents; the generation cache holds the key/value latent"),
    "q_lora_rank": "MLA: width of the query latent (default: queries projected straight from the hidden state)",
    "kv_lora_rank": "MLA: width of the key/value latent",
    "qk_head_dim": "MLA: query/key channels per head without rotary embedding",
    "qk_pos_emb_head_dim": "MLA: query/key channels per head with rotary embedding (the key's shared by all heads)",
    "v_head_dim": "MLA: value channels per head",
    "rope_type": "MLA's rotary embedding, rope or yarn (default: yarn; other attention: --position-embedding-type)",
    "untie_embeddings_and_output_weights": "give the output layer its own weight instead of the input embedding's",
    "pad_token_id": ("the padding token's id, the embedding row --freeze-padding-embedding freezes (an imported "
                     "model records its config.json's pad_token_id)"),
    "freeze_padding_embedding": ("give the pad token's input-embedding row no gradient, as transformers' "
                                 "padding_idx (default: every row trains, as in Megatron-LM)"),
    "hidden_dropout": "dropout on the attention and MLP outputs",
    "attention_dropout": "dropout on the attention probabilities",
    "hf_model_type": "the Hugging Face family (config.json's model_type) a Hugging Face export writes; an imported "
                     "model records its own, and runs that load it keep it",
    "init_method_std": "standard deviation of the normal weight init (output projections are scaled by depth)",
    "make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this x tensor-parallel size",
    "use_fused_kernels": "use the PyTorch reference ops instead of the fused CUDA kernels",
    "num_experts": "experts of each mixture-of-experts layer (default: none, every MLP dense)",
    "moe_ffn_hidden_size": "inner width of each expert (default --ffn-hidden-size)",
    "moe_layer_freq": ('which layers are mixture-of-experts: N (every Nth, from the first) or a list of 0s and 1s '
                       'per layer, e.g. "([0]+[1]*23)" for a first dense layer (parsed, not eval\'d as in '
                       'Megatron-LM, which also keeps the text as an int)'),
    "moe_router_topk": "experts each token is routed to",
    "moe_router_score_function": ("router scores: softmax (Mixtral, Qwen-MoE) or sigmoid, normalised over the "
                                  "top-k when k > 1 (DeepSeek-V3; the top-1's sigmoid as it is: Llama 4)"),
    "moe_router_pre_softmax": ("softmax over all experts before choosing the top-k, which are then not "
                               "renormalised (OLMoE, Qwen2-MoE); default: softmax over the top-k logits"),
    "moe_router_topk_scaling_factor": "multiply the top-k routing weights by this (DeepSeek's routed_scaling_factor)",
    "moe_router_num_groups": ("group-limited routing: the experts form this many groups, and each token picks "
                              "--moe-router-group-topk groups first (DeepSeek's device/node-limited routing)"),
    "moe_router_group_topk": "with --moe-router-num-groups: groups each token's experts may come from",
    "moe_router_group_score": ("how --moe-router-num-groups' groups are scored: topk_sum, the sum of each group's "
                               "best topk / group-topk scores (Megatron-LM's, DeepSeek-V3's), or max, its best score "
                               "(DeepSeek-V2's group_limited_greedy; not a Megatron-LM option)"),
    "moe_router_load_balancing_type": ("aux_loss (Switch Transformer's, per micro-batch and layer), seq_aux_loss "
                                       "(per sequence, DeepSeek), pooled_aux_loss (the statistics of all layers "
                                       "pooled, as transformers' MoE models; not a Megatron-LM type) or none"),
    "moe_aux_loss_coeff": "weight of the load-balancing loss in the training loss (1e-2 is a common start)",
    "moe_z_loss_coeff": "weight of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE)",
    "moe_router_enable_expert_bias": ("aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the sigmoid "
                                      "scores, used only to choose experts, moved once per global batch towards "
                                      "an equal token count"),
    "moe_router_bias_update_rate": "with --moe-router-enable-expert-bias: the bias step per global batch",
    "moe_expert_capacity_factor": ("drop tokens past capacity = factor x tokens x top-k / experts per expert and "
                                   "micro-batch (default: dropless)"),
    "moe_pad_expert_input_to_capacity": "with --moe-expert-capacity-factor: every expert computes exactly its capacity",
    "moe_token_drop_policy": "which tokens past capacity are dropped: lowest routing probability, or last in position",
    "moe_shared_expert_intermediate_size": "inner width of the shared expert every token also passes through",
    "moe_shared_expert_gate": "scale the shared expert's output by sigmoid of a learned projection (Qwen2-MoE)",
    "moe_apply_probs_on_input": ("scale each expert's input by its routing weight instead of its output (Llama 4; "
                                 "with --moe-router-topk 1)"),
    "moe_grouped_gemm": ("run each rank's experts as one grouped GEMM (torch._grouped_mm) instead of a loop over "
                         "experts"),
    # parallel
    "tensor_model_parallel_size": "GPUs each layer is split across (keep within a node)",
    "pipeline_model_parallel_size": "pipeline stages the layers are split into",
    "context_parallel_size": "GPUs each sequence is split across (every activation; attention exchanges keys and "
                             "values); the sequence is cut into 2 x this many chunks, rank i holding chunks i and "
                             "2 x size - 1 - i",
    "cp_comm_type": "how context-parallel attention exchanges keys and values: p2p (a ring, overlapped with each "
                    "block's attention) or all_gather (Megatron-LM: allgather); one value, or one per layer",
    "expert_model_parallel_size": "ranks the experts of each mixture-of-experts layer are divided over",
    "expert_tensor_parallel_size": ("ranks each expert's weights are split across (default "
                                    "--tensor-model-parallel-size, which Megatron-LM's validation writes in)"),
    "virtual_pipeline_model_parallel_size": "model chunks per pipeline stage (interleaved 1F1B)",
    "num_layers_per_virtual_pipeline_stage": "layers per model chunk; sets --virtual-pipeline-model-parallel-size",
    "decoder_first_pipeline_num_layers": "layers on the first pipeline stage (uneven split)",
    "decoder_last_pipeline_num_layers": "layers on the last pipeline stage (uneven split)",
    "sequence_parallel": "split norms and dropout along the sequence over the tensor-parallel ranks",
    "use_distributed_optimizer": "shard optimizer state and fp32 main weights over data-parallel ranks (ZeRO-1); "
                                 "the same as --data-parallel-sharding-strategy optim",
    "data_parallel_sharding_strategy": "what data-parallel ranks shard: optimizer state (optim, ZeRO-1), + gradients "
                                       "(optim_grads, ZeRO-2), + parameters (optim_grads_params, ZeRO-3) "
                                       "(default no_shard; optim with --use-distributed-optimizer. Megatron-LM's "
                                       "default optim_grads_params applies only to its --use-megatron-fsdp)",
    "grad_cpu_offload": "with optim_grads(_params) and --optimizer-cpu-offload: keep the fp32 gradient shards "
                        "in CPU memory too",
    "overlap_grad_reduce": "reduce gradient buckets during backward instead of after it",
    "overlap_param_gather": "all-gather updated parameters during the next forward (distributed optimizer); "
                            "ZeRO-3: prefetch the next layer's parameters",
    "ddp_bucket_size": "elements per gradient bucket (default max(40M, 1M x data-parallel size); ZeRO-3: a layer)",
    "accumulate_allreduce_grads_in_fp32": "keep and reduce gradients in fp32 under bf16/fp16",
    "grad_reduce_in_bf16": "with --bf16: accumulate and reduce gradients in bf16 (the optimizer still gets fp32)",
    "distributed_backend": "torch.distributed backend (default nccl with CUDA, as Megatron-LM; gloo without)",
    "distributed_timeout_minutes": ("a collective that waits longer than this fails (every process group), naming "
                                    "each rank's last collective"),
    # training
    "micro_batch_size": ("sequences per forward/backward on one data-parallel rank (Megatron-LM requires the flag; "
                         "1 here lets a flag-less tiny run start)"),
    "global_batch_size": "sequences per optimizer step (default micro batch x data-parallel size)",
    "train_iters": "optimizer steps to train for (default 100 when neither --train-samples nor --train-epochs "
                   "is given)",
    "train_epochs": "passes over the training data (HF Trainer's num_train_epochs; may be fractional): the fewest "
                    "iterations whose batches cover that many times the train split's samples; the LR schedule "
                    "counts iterations",
    "train_samples": "sequences to train on instead of --train-iters; the LR schedule then counts samples too",
    "rampup_batch_size": ("START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT "
                          "until it reaches --global-batch-size after SAMPLES samples"),
    "step_batch_size_schedule": ('"THRESHOLD:BATCH ..." (spaces or commas; thresholds in tokens, suffixes K M B T, '
                                 'the first 0): the global batch from THRESHOLD tokens consumed on; the last batch '
                                 'is the global batch'),
    "calculate_per_token_loss": ("loss summed over tokens and divided by the global batch's loss tokens (no "
                                 "averaging over micro-batches and data-parallel ranks)"),
    "seed": "random seed (weights, data order, dropout)",
    "bf16": "bfloat16 weights and activations, fp32 main weights",
    "fp16": "float16 weights and activations with a dynamic loss scaler",
    "recompute_granularity": "activation recomputation: full layers or the selective attention core",
    "recompute_method": "with full recomputation: uniform (every layer) or block (the first N per stage)",
    "recompute_num_layers": "layers per recomputed group (uniform) or recomputed layers per stage (block)",
    "eval_interval": ("iterations between validation runs (Megatron-LM's earlier default; its current None fails "
                      "in its validation sample count at d98e8a6)"),
    "eval_iters": "global batches per validation run",
    "exit_signal_handler": "on SIGTERM or SIGINT save a checkpoint and exit (all ranks, same iteration)",
    "exit_interval": "save and exit after this many iterations",
    "exit_duration_in_mins": "save and exit once this many minutes have passed (all ranks, same iteration)",
    "check_weight_hash_across_dp_replicas_interval": "every N iterations check all data-parallel replicas agree",
    "manual_gc": "turn off Python's automatic garbage collection; collect at iteration boundaries instead",
    "manual_gc_interval": "with --manual-gc: collect every N iterations (0: only around evaluation)",
    "peft_without_base_checkpoint": ("let --peft train adapters on a randomly initialised frozen model when no "
                                     "--pretrained-checkpoint or --load checkpoint is given (tests, smoke runs)"),
    "manual_gc_eval": "with --manual-gc: do not collect around evaluation",
    "check_for_nan_in_loss_and_grad": ("train on when the loss or grad norm is NaN or infinite (by default the run "
                                       "stops with an error naming the iteration and rank, before it saves)"),
    "rerun_mode": ("validate_results: a rejected result (NaN or Inf, a spike) re-runs its iteration from the same "
                   "state and micro-batches; a different result was a transient fault and training goes on, the same "
                   "one stops the run (exit 17) naming iteration, rank and samples. report_stats: re-run every "
                   "iteration and log how reproducible its results are. disabled: no re-run (NaN still stops)"),
    "check_for_spiky_loss": "a loss over 10x the largest of the first 100 is rejected (re-run, never stops the run)",
    "check_for_large_grads": "a grad norm over 10x the largest of the first 100 is rejected (re-run, never stops)",
    "error_injection_rate": ("--rerun-mode validate_results: reject a result once every N validations, to test "
                             "the re-run (0: never)"),
    "error_injection_type": ("what an injected rejection acts as: correct_result (the re-run reproduces a sound "
                             "result), transient_error (the re-run differs) or persistent_error (it reproduces)"),
    "empty_unused_memory_level": ("torch.cuda.empty_cache(): 1 after each forward-backward and evaluation step, "
                                  "2 also after each optimizer step"),
    "dpo_loss_type": ("--dpo: sigmoid (the DPO paper's, with --dpo-label-smoothing its conservative form), ipo "
                      "(squared, on per-token log-ratios) or hinge; without a reference model: simpo (per-token "
                      "log-probabilities, a target margin) or orpo (odds ratio plus the chosen side's NLL)"),
    "dpo_beta": "--dpo: the strength of the pull to the reference (beta; IPO's tau; SimPO's beta; ORPO's lambda)",
    "dpo_label_smoothing": ("--dpo --dpo-loss-type sigmoid or simpo: the assumed fraction of pairs whose preference "
                            "is flipped (conservative DPO), in [0, 0.5)"),
    "dpo_simpo_gamma": "--dpo-loss-type simpo: the target reward margin gamma (TRL's simpo_gamma)",
    "dpo_cpo_alpha": ("--dpo-loss-type simpo: weight of the chosen answers' per-token NLL added to the loss (TRL's "
                      "cpo_alpha: CPO-SimPO; 0, SimPO's own, adds none)"),
    "dpo_precompute_ref_log_probs": ("--dpo: score every pair the run will read (train, validation, test) with the "
                                     "reference in one forward-only pass before training, then free the reference's "
                                     "copy (TRL's precompute_ref_log_probs)"),
    # optimizer
    "optimizer": ("adam (AdamW), sgd, lion, or muon (Newton-Schulz-orthogonalised momentum on the weight matrices, "
                  "--muon-scalar-optimizer on the rest; docs/training.md)"),
    "lr": "peak learning rate (Megatron-LM requires the flag; 3e-4 here lets a flag-less tiny run start)",
    "min_lr": "learning rate at the end of the decay",
    "lr_decay_style": ("decay after warmup: constant, linear, cosine, inverse-square-root (--lr x sqrt(warmup / "
                       "step), not below --min-lr), or WSD (stable at --lr, then --lr-wsd-decay-style down to --min-lr "
                       "over the decay's last --lr-wsd-decay-iters/-samples). Default linear, as Megatron-LM"),
    "lr_wsd_decay_style": "with --lr-decay-style WSD: the annealing curve (exponential, linear, cosine, minus_sqrt)",
    "lr_wsd_decay_iters": "with --lr-decay-style WSD: iterations of annealing, ending at --lr-decay-iters",
    "lr_wsd_decay_samples": "with --lr-decay-style WSD and --train-samples: samples of annealing",
    "lr_warmup_init": "learning rate at the start of warmup, rising to --lr (--lr-warmup-style)",
    "lr_warmup_style": ("warmup curve from --lr-warmup-init to --lr: linear (Megatron-LM's), or log (DeepSpeed's "
                        "WarmupLR default): init + (lr - init) x ln(1 + iteration) / ln(warmup iterations), at least "
                        "2 of them. megatron_lite's own flag (Megatron-LM has none); --deepspeed-config sets it"),
    "lr_warmup_iters": "iterations of warmup (linear unless --lr-warmup-style log)",
    "lr_decay_iters": "iteration at which the decay reaches --min-lr (default --train-iters)",
    "lr_warmup_samples": "with --train-samples: samples of warmup (linear unless --lr-warmup-style log)",
    "lr_decay_samples": "with --train-samples: sample at which the decay reaches --min-lr (default --train-samples)",
    "lr_warmup_fraction": "warmup as this fraction of the decay (instead of --lr-warmup-iters/-samples)",
    "decoupled_lr": "peak learning rate of the word embedding and output layer (same warmup and decay shape)",
    "decoupled_min_lr": "final learning rate of the word embedding and output layer (default --min-lr)",
    "weight_decay": "decoupled weight decay (not on biases and norms)",
    "start_weight_decay": "weight decay at iteration 0 (with --end-weight-decay)",
    "end_weight_decay": "weight decay at the last iteration",
    "weight_decay_incr_style": "how weight decay moves from start to end: constant, linear or cosine",
    "adam_beta1": "Adam first-moment decay",
    "adam_beta2": "Adam second-moment decay",
    "adam_eps": "Adam denominator epsilon",
    "sgd_momentum": "momentum with --optimizer sgd",
    "muon_momentum": "Muon's momentum (an average: M = m M + (1 - m) G)",
    "muon_split_qkv": ("Muon orthogonalises Q, K and V (and SwiGLU's gate and up) as separate matrices; the flag "
                       "keeps them fused"),
    "muon_nesterov": "Muon's update interpolates towards the gradient (Nesterov)",
    "muon_scale_mode": ("scale of Muon's orthogonalised update of an [out, in] matrix: spectral sqrt(max(out, in)), "
                        "unit_rms_norm sqrt(out / in), shape_scaling sqrt(max(1, out / in))"),
    "muon_fp32_matmul_prec": "Newton-Schulz matmuls: high in fp32, medium or low in bf16 (as torch.optim.Muon)",
    "muon_coefficient_type": ("Newton-Schulz coefficients: simple (torch.optim.Muon's one triple) or quintic "
                              "(five, cycled)"),
    "muon_num_ns_steps": "Newton-Schulz iterations per Muon step",
    "muon_tp_mode": ("Muon under tensor parallelism: duplicated (gather the matrix) and distributed (sum the Gram "
                     "matrix) equal one process; blockwise orthogonalises each shard alone, so depends on "
                     "--tensor-model-parallel-size"),
    "muon_extra_scale_factor": "a further multiplier of Muon's update (0.2 with spectral matches AdamW's update RMS)",
    "muon_scalar_optimizer": "the optimizer of what Muon leaves out (embeddings, output layer, norms, biases)",
    "lion_beta1": "Lion's interpolation of momentum and gradient inside the sign",
    "lion_beta2": "Lion's momentum decay",
    "clip_grad": "clip the global gradient L2 norm to this (0 disables)",
    "loss_scale": "static fp16 loss scale (default: dynamic)",
    "initial_loss_scale": "first dynamic fp16 loss scale",
    "min_loss_scale": "the dynamic loss scale never goes below this",
    "loss_scale_window": "clean iterations before the dynamic loss scale doubles",
    "hysteresis": "overflows tolerated before the dynamic loss scale halves",
    "optimizer_cpu_offload": "keep optimizer state and fp32 main weights in CPU memory",
    "override_opt_param_scheduler": "on resume, use this run's LR schedule flags (e.g. to extend --train-iters)",
    "use_checkpoint_opt_param_scheduler": "on resume, use the checkpoint's LR schedule and ignore this run's flags",
    # data
    "data_path": "PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... to blend (.bin/.idx from tools/preprocess_data.py)",
    "split": "train,valid,test weights over documents, e.g. 969,30,1",
    "mock_data": "train on synthetic tokens (needs --vocab-size); the loss will not fall",
    "tokenizer_type": "which tokenizer the data was made with",
    "vocab_file": "GPT2BPETokenizer's vocab.json",
    "merge_file": "GPT2BPETokenizer's merges.txt",
    "tokenizer_model": ("SentencePiece .model file, Hugging Face tokenizer.json (or its directory), or "
                        "TikTokenizer's JSON vocabulary"),
    "tiktoken_pattern": "TikTokenizer's pre-tokenisation regex, v1 or v2 (default v2); other tokenizers ignore it",
    "tiktoken_num_special_tokens": "TikTokenizer's special-token ids, which come before the BPE tokens",
    "data_cache_path": "where the sample-index cache goes (default: beside the data)",
    "eod_mask_loss": "no loss on positions whose input is the end-of-document token",
    "num_workers": ("DataLoader worker processes per rank (Megatron-LM's default is 2; 0 here reads in the training "
                    "process: the same samples in the same order, no worker processes to start on small runs)"),
    "mmap_bin_files": "read .bin files with one file read per sample instead of memory-mapping them",
    "sft": ("supervised fine-tuning: prompt/response or chat data from --train-data-path, loss on the responses "
            "only, averaged per token over the global batch"),
    "train_data_path": ("--sft: JSONL, JSON-array, Parquet or Arrow files (or datasets.save_to_disk directories) of "
                        "prompt/response, messages, Alpaca or ShareGPT records, or --output-prefix of "
                        "tools/preprocess_data.py --sft"),
    "valid_data_path": "--sft: validation data, as --train-data-path",
    "test_data_path": "--sft: test data, as --train-data-path, evaluated once after training",
    "sft_tokenizer_prompt_format": ("--sft: how a conversation becomes text: plain (as written), chatml, or default "
                                    "(the Hugging Face tokenizer's own chat template). Megatron-LM's default, "
                                    "nemotron-h-aligned, is not among megatron_lite's formats"),
    "sft_pack_sequences": ("--sft: pack several examples per sequence (positions restart, attention stays within "
                           "each example) instead of padding one"),
    "sft_format": ("--sft: the records' shape: prompt_response, messages, alpaca (instruction/input/output) or "
                   "sharegpt (conversations); auto tells each record's from its keys"),
    "sft_data_keys": ("--sft: NAME=COLUMN ...: read the data's COLUMN as NAME (prompt, response, messages, "
                      "instruction, input, output, system, history, conversations), e.g. prompt=question "
                      "response=answer"),
    "dpo": ("direct preference optimisation on --train-data-path records {\"prompt\", \"chosen\", \"rejected\"} "
            "(strings or message lists, or a prefix of tools/preprocess_data.py --dpo), against a frozen reference: "
            "--pretrained-checkpoint, or under --peft lora the base with the adapters off (none for --dpo-loss-type "
            "simpo and orpo). Batch sizes count sequences, two per pair"),
    "grpo": ("group relative policy optimisation: sample --grpo-group-size completions of each --train-data-path "
             "prompt ({\"prompt\"} or {\"messages\"}) from the policy, score them with --reward-function and train on "
             "the group-normalised rewards (TRL's GRPO loss). Batch sizes count completions"),
    # checkpoint
    "save": "directory for checkpoints (checked for writability at start-up)",
    "load": "resume from this directory's newest checkpoint; starts from scratch if it holds none",
    "save_interval": "iterations between checkpoints (one is always saved at the end)",
    "async_save": ("write checkpoints in the background while training goes on: the step only copies the state "
                   "to CPU memory (as much again of host memory as the rank's checkpoint); the tracker moves once "
                   "every rank's files are written and verified; the next save and the end of training wait"),
    "no_load_optim": "on load, skip the optimizer state",
    "no_load_rng": "on load, skip the random-number generator states",
    "finetune": "load weights only and start at iteration 0; --load must hold a checkpoint",
    "pretrained_checkpoint": ("checkpoint to fine-tune from, loaded like --finetune (weights only, iteration 0) "
                              "while --load holds no checkpoint; once it does, a restarted job resumes from --load"),
    "use_checkpoint_args": ("take the model's settings from the checkpoint to be loaded (--load, else "
                            "--pretrained-checkpoint), its vocabulary size included, and its tokenizer unless "
                            "--tokenizer-type is given. Model flags given as well must agree with the checkpoint "
                            "where they change what its weights compute (an error lists those that do not; "
                            "Megatron-LM overrides them silently); --seq-length and the dropouts given override the "
                            "checkpoint's; --no-fused-kernels stays this machine's choice"),
    # logging
    "log_interval": "iterations between log lines",
    "tensorboard_dir": "write TensorBoard scalars here (pip install \"megatron_lite[loggers]\")",
    "wandb_project": ("log the scalars of the log lines to this Weights & Biases project (pip install "
                      "\"megatron_lite[loggers]\"; WANDB_MODE=offline logs without network)"),
    "wandb_exp_name": "the W&B run's name",
    "wandb_save_dir": "where W&B writes its files (default: --save/wandb, else ./wandb)",
    "wandb_entity": "the W&B team or user the project belongs to",
    "peak_tflops": "peak TFLOP/s of one device, for MFU (default: looked up for known GPUs)",
    "log_memory": "no memory report and throughput line",
    "log_throughput": "TFLOP/s per GPU in the iteration line",
    "log_straggler": ("every --log-interval, the spread of the ranks' step times (time outside collectives), the "
                      "slowest and fastest rank named (one all-gather of a float)"),
    "profile": "write a torch.profiler trace of iterations --profile-step-start..end into --tensorboard-dir",
    "profile_step_start": "first profiled iteration",
    "profile_step_end": "iteration the profile stops before",
    "profile_ranks": "global ranks to profile (default: all)",
    # peft
    "peft": ("parameter-efficient fine-tuning: lora (low-rank updates of linear layers), adapter (bottleneck "
             "adapters after attention and MLP) or prefix (learned key/value prefixes); the base weights are frozen "
             "and checkpoints hold only the added weights"),
    "lora_rank": "rank r of the LoRA update B A",
    "lora_alpha": "LoRA scale: the update is multiplied by alpha / r",
    "lora_dropout": "dropout on the input of the LoRA branch",
    "lora_target_modules": ("the linear layers LoRA adapts, any of linear_qkv linear_proj linear_fc1 linear_fc2 "
                            "(default: all four) or, with --multi-latent-attention, linear_q_proj linear_q_down_proj "
                            "linear_q_up_proj linear_kv_down_proj linear_kv_up_proj (linear_qkv: all of these "
                            "the model has)"),
    "adapter_dim": "bottleneck width of the adapters (--peft adapter)",
    "prefix_length": "learned key/value vectors prepended in every layer (--peft prefix)",
    "prefix_projection_hidden_size": ("produce the prefixes during training through a two-layer MLP of this width "
                                      "(Li and Liang's reparametrisation; default: learn them directly)"),
    # grpo
    "reward_function": ("--grpo: FILE.py:NAME ... (the flag may repeat): functions f(prompts, completions, "
                        "completion_ids, **columns) -> one float per completion, TRL's reward-function signature; "
                        "columns are the prompt records' other fields"),
    "reward_weights": "--grpo: one weight per --reward-function (default: 1 each); the reward is their weighted sum",
    "grpo_group_size": "--grpo: completions sampled per prompt, whose rewards are normalised together",
    "max_new_tokens": "--grpo: the most tokens of a completion (it ends earlier at EOD)",
    "temperature": "--grpo: sampling temperature; the log-probabilities trained on are of logits / temperature",
    "top_p": "--grpo: sample from the smallest set of tokens whose probability reaches top-p (0: every token)",
    "grpo_epsilon": "--grpo: the probability ratio is clipped to [1 - epsilon, 1 + epsilon-high]",
    "grpo_epsilon_high": "--grpo: the ratio's upper clip (default: --grpo-epsilon; DAPO's clip-higher uses 0.28)",
    "grpo_beta": "--grpo: weight of the k3 KL penalty to the reference model; 0 builds no reference",
    "grpo_iterations": "--grpo: optimizer steps on each batch of completions (mu): the ratio is to the policy that "
                       "sampled them",
    "grpo_loss_type": ("--grpo: dapo (TRL's default: per-token losses over the global batch's completion tokens), "
                       "grpo (per completion, then over completions), bnpo (over each micro-batch's completion "
                       "tokens, then over micro-batches) or dr_grpo (over completions x --max-new-tokens)"),
    "grpo_scale_rewards": ("--grpo: divide the group-centred rewards by the group's std (group), the whole batch's "
                           "(batch), or not (none)"),
    "grpo_log_completions": ("--grpo: write every prompt, completion and reward to this JSONL file, iteration by "
                             "iteration"),
}
