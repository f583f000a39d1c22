"""Typed configuration: one dataclass per concern, validated on construction.

Every error names the command-line flag at fault and what to do about it, so a
user who mistypes a launch script learns the fix before any process group is
built. Each field is one flag (``megatron_lite/cli/`` maps Megatron-LM's flags onto these
dataclasses; how to add one is in its docstring): a field's ``choices`` metadata and its
section's ``__post_init__`` are the whole validation, so a Config built in code is checked
exactly as one parsed from flags. This package imports nothing of megatron_lite above it.

    fields.py      a field as its flag; the choices check and ``require`` every section uses
    model.py       ModelConfig (moe.py: its mixture-of-experts fields)
    parallel.py    ParallelConfig
    training.py    TrainingConfig (batch_size_schedule.py: --step-batch-size-schedule)
    optimizer.py   OptimizerConfig
    data.py        DataConfig
    checkpoint.py  CheckpointConfig
    logging.py     LoggingConfig
    peft.py        PeftConfig
    grpo.py        GRPOConfig
    __init__.py    Config, which checks the sections against each other

Every name of these modules that code imports is importable from ``megatron_lite.config`` too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_lite.config.checkpoint import CheckpointConfig
from megatron_lite.config.data import (SFT_DATA_KEY_NAMES, SFT_FORMATS, SFT_PROMPT_FORMATS,  # noqa: F401
                                       TOKENIZER_TYPES, DataConfig, check_sft_data_keys)
from megatron_lite.config.errors import ConfigError, UserError  # noqa: F401 (imported from here everywhere)
from megatron_lite.config.fields import (NEGATIVE_FLAGS, as_flags, check_choices, flag_is_on,  # noqa: F401
                                         flag_name, require)
from megatron_lite.config.grpo import GRPO_LOSS_TYPES, GRPO_SCALE_REWARDS, GRPOConfig  # noqa: F401
from megatron_lite.config.logging import LoggingConfig
from megatron_lite.config.model import (ATTENTION_BACKENDS, NORMALIZATIONS, POSITION_EMBEDDING_TYPES,  # noqa: F401
                                        ROPE_TYPES, YARN_DEFAULTS, ModelConfig, default_ffn_hidden_size)
from megatron_lite.config.optimizer import (LR_DECAY_STYLES, LR_WARMUP_STYLES, MUON_COEFFICIENT_TYPES,  # noqa: F401
                                            MUON_SCALE_MODES, WEIGHT_DECAY_INCR_STYLES, WSD_DECAY_STYLES,
                                            OptimizerConfig)
from megatron_lite.config.parallel import CP_COMM_TYPES, SHARDING_STRATEGIES, ParallelConfig  # noqa: F401
from megatron_lite.config.peft import (LORA_TARGET_MODULES, PEFT_METHODS, PeftConfig,  # noqa: F401
                                       latent_projections, lora_targets_of)
from megatron_lite.config.training import (DEFAULT_TRAIN_ITERS, DPO_LOSS_TYPES, ERROR_INJECTION_TYPES,  # noqa: F401
                                           REFERENCE_FREE_DPO_LOSS_TYPES, RERUN_MODES, RUN_LENGTH_FIELDS,
                                           TrainingConfig)


@dataclass(kw_only=True)
class Config:
    """Everything a run needs. Cross-section checks live here."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(mock_data=True))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        model, parallel = self.model, self.parallel
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        require(model.num_attention_heads % tp == 0,
                 f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole heads.")
        require(model.num_query_groups % tp == 0,
                 f"--num-query-groups ({model.num_query_groups}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole key/value groups.")
        require(model.ffn_hidden_size % tp == 0,
                 f"--ffn-hidden-size ({model.ffn_hidden_size}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}).")
        _check_expert_parallel(model, parallel)
        _check_linear_attention_layout(model, parallel)
        require(model.num_experts is None or model.moe_router_load_balancing_type != "pooled_aux_loss"
                 or self.training.recompute_granularity != "full",
                 "--moe-router-load-balancing-type pooled_aux_loss pools each micro-batch's routing over all layers, "
                 "which a layer recomputed in backward (--recompute-granularity full) would not see again: use "
                 "--recompute-granularity selective, or aux_loss.")
        _check_expert_lora(model, parallel, self.peft)
        require(not parallel.sequence_parallel or model.seq_length % tp == 0,
                 f"--sequence-parallel splits the sequence: --seq-length ({model.seq_length}) must be "
                 f"divisible by --tensor-model-parallel-size ({tp}).")
        _check_context_parallel(model, parallel)
        if parallel.num_layers_per_virtual_pipeline_stage is not None:
            per_stage = model.num_layers // pp
            require(per_stage % parallel.num_layers_per_virtual_pipeline_stage == 0,
                     f"--num-layers-per-virtual-pipeline-stage ({parallel.num_layers_per_virtual_pipeline_stage}) "
                     f"must divide the layers per pipeline stage ({model.num_layers} / {pp} = {per_stage}).")
            parallel.virtual_pipeline_model_parallel_size = (
                per_stage // parallel.num_layers_per_virtual_pipeline_stage)
        require(not parallel.grad_cpu_offload or self.optimizer.optimizer_cpu_offload,
                 "--grad-cpu-offload hands host-memory gradient shards to the optimizer, which then must step on "
                 "the host too: add --optimizer-cpu-offload.")
        require(not parallel.shards_parameters or self.training.check_weight_hash_across_dp_replicas_interval is None,
                 "--check-weight-hash-across-dp-replicas-interval compares the data-parallel replicas' weights, but "
                 "--data-parallel-sharding-strategy optim_grads_params keeps no replicas (each rank holds a "
                 "different shard): drop the flag or pick a strategy that keeps whole parameters.")
        _check_peft_on_model(self.peft, model)
        _check_dpo(self)
        _check_multi_token_prediction(self)
        _check_grpo(self)
        _check_schedule_units(self.training, self.optimizer)
        self.training.step_schedule_in_samples(model.seq_length)  # thresholds closer than a sequence fail here
        if self.training.train_iters is not None and self.optimizer.lr_decay_iters is None:
            self.optimizer.lr_decay_iters = self.training.train_iters
        if self.training.train_samples is not None and self.optimizer.lr_decay_samples is None:
            self.optimizer.lr_decay_samples = self.training.train_samples
        self.optimizer.check_warmup_before_decay()

    def set_train_iters_from_epochs(self, train_iters: int) -> None:
        """--train-epochs, once counted into iterations at start-up, becomes --train-iters: the LR schedule's
        default decay, the checks and a saved config then read as if that had been given."""
        self.training.train_epochs, self.training.train_iters = None, train_iters
        if self.optimizer.lr_decay_iters is None:
            self.optimizer.lr_decay_iters = train_iters
        self.optimizer.check_warmup_before_decay()

    @property
    def params_dtype(self):
        import torch
        if self.training.bf16:
            return torch.bfloat16
        if self.training.fp16:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{name: section(**d[name]) for name, section in SECTIONS.items() if name in d})


def _check_dpo(config: "Config") -> None:
    """--dpo needs a frozen reference (the checkpoint it starts from, or LoRA's base with the adapters off) unless
    its loss is reference-free, and takes its pairs whole: a pair is two consecutive sequences of a micro-batch."""
    training = config.training
    if not config.data.dpo:
        require(not training.dpo_precompute_ref_log_probs, "--dpo-precompute-ref-log-probs needs --dpo.")
        return
    loss_type = training.dpo_loss_type
    if not training.dpo_uses_reference:
        require(not training.dpo_precompute_ref_log_probs,
                 f"--dpo-precompute-ref-log-probs: --dpo-loss-type {loss_type} has no reference model to precompute; "
                 f"drop the flag.")
    else:
        require(bool(config.checkpoint.pretrained_checkpoint) or config.peft.peft == "lora",
                 "--dpo needs a reference model: give --pretrained-checkpoint CKPT (kept frozen as the reference, "
                 "and the policy starts from it), or --peft lora (the reference is the base with the adapters off), "
                 "or a loss without one (--dpo-loss-type simpo or orpo).")
    require(training.dpo_label_smoothing == 0 or loss_type in ("sigmoid", "simpo"),
             f"--dpo-label-smoothing smooths the sigmoid and simpo losses, not --dpo-loss-type {loss_type}.")
    require(loss_type == "simpo" or (training.dpo_cpo_alpha == 0 and training.dpo_simpo_gamma == 0.5),
             f"--dpo-cpo-alpha and --dpo-simpo-gamma are SimPO's: add --dpo-loss-type simpo (got {loss_type}).")
    require(config.training.micro_batch_size % 2 == 0,
             f"--dpo: a micro-batch holds whole pairs, two sequences each (chosen, rejected): --micro-batch-size "
             f"must be even, got {config.training.micro_batch_size}.")
    require(config.training.rampup_batch_size is None and config.training.step_batch_size_schedule is None,
             "--dpo takes a fixed global batch of pairs: drop --rampup-batch-size/--step-batch-size-schedule.")
    require(config.data.sft_format == "auto" and not config.data.sft_data_keys,
             "--sft-format and --sft-data-keys say how to read supervised fine-tuning records; --dpo reads TRL's "
             "preference records (prompt, chosen, rejected): drop them.")


def _check_multi_token_prediction(config: "Config") -> None:
    if config.model.mtp_num_layers is None:
        return
    require(config.parallel.context_parallel_size == 1,
             "--mtp-num-layers with --context-parallel-size > 1: each depth rolls the tokens one position left, "
             "which crosses the context-parallel ranks' chunks (Megatron-LM exchanges their boundaries); "
             "megatron_lite does not: train multi-token prediction without context parallelism.")
    for method, on in (("--dpo", config.data.dpo), ("--grpo", config.data.grpo)):
        require(not on, f"--mtp-num-layers with {method}: its loss has no next-token targets for the multi-token "
                        f"prediction layers; drop one.")


def _check_grpo(config: "Config") -> None:
    """--grpo needs a reward; a KL penalty needs a reference (as --dpo's); generation runs on the one model chunk
    of each rank with whole sequences and parameters (training/grpo.py)."""
    data, parallel = config.data, config.parallel
    if not data.grpo:
        require(not config.grpo.reward_function, "--reward-function scores --grpo's completions: add --grpo.")
        return
    require(bool(config.grpo.reward_function),
             "--grpo needs --reward-function FILE.py:NAME (a function f(prompts, completions, **columns) returning "
             "one float per completion, as TRL's GRPOTrainer calls it).")
    require(config.grpo.grpo_beta == 0 or bool(config.checkpoint.pretrained_checkpoint) or config.peft.peft == "lora",
             "--grpo-beta > 0 needs a reference model: give --pretrained-checkpoint CKPT (kept frozen as the "
             "reference), or --peft lora (the base with the adapters off), or --grpo-beta 0 (no KL penalty).")
    require(not (data.valid_data_path or data.test_data_path),
             "--grpo has no validation loss (its loss needs completions sampled from the policy): drop "
             "--valid-data-path/--test-data-path.")
    require(not data.sft_pack_sequences and data.sft_format == "auto" and not data.sft_data_keys,
             "--grpo reads prompts ({\"prompt\"} or {\"messages\"}), one completion per sequence: drop "
             "--sft-pack-sequences/--sft-format/--sft-data-keys.")
    require(config.training.rampup_batch_size is None and config.training.step_batch_size_schedule is None,
             "--grpo takes a fixed global batch of completions: drop --rampup-batch-size/--step-batch-size-schedule.")
    unsupported = [flag for flag, on in (("--sequence-parallel", parallel.sequence_parallel),
                                         ("--context-parallel-size", parallel.context_parallel_size > 1),
                                         ("--expert-model-parallel-size", parallel.expert_model_parallel_size > 1),
                                         ("--virtual-pipeline-model-parallel-size",
                                          (parallel.virtual_pipeline_model_parallel_size or 1) > 1),
                                         ("--data-parallel-sharding-strategy optim_grads_params",
                                          parallel.shards_parameters)) if on]
    require(not unsupported, f"--grpo generates with the training model one token at a time, on one model chunk "
                             f"with whole parameters and sequences per rank: drop {', '.join(unsupported)}.")


def _check_peft_on_model(peft: PeftConfig, model: ModelConfig) -> None:
    """Multi-latent attention has no prefix slot, and ``linear_qkv`` there means its query and key/value
    projections; a target the model lacks is an error naming those it has."""
    require(not (peft.peft == "prefix" and model.multi_latent_attention),
             "--peft prefix prepends keys and values to each head's, which --multi-latent-attention expands from a "
             "latent: fine-tune it with --peft lora or adapter.")
    require(not (peft.peft == "prefix" and model.experimental_attention_variant is not None),
            "--peft prefix prepends keys and values to each attention head's, which a gated DeltaNet layer "
            "(--experimental-attention-variant gdn) has none of: fine-tune it with --peft lora or adapter.")
    if peft.peft != "lora":
        return
    targets = set(peft.lora_target_modules)
    if model.multi_latent_attention and "linear_qkv" in targets:
        targets = (targets - {"linear_qkv"}) | set(latent_projections(model))
    missing = sorted(targets - set(lora_targets_of(model)))
    require(not missing, f"--lora-target-modules {' '.join(missing)}: this model's linear layers are "
                          f"{' '.join(lora_targets_of(model))}.")
    peft.lora_target_modules = [m for m in LORA_TARGET_MODULES if m in targets]


def _check_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The sequence splits into 2 x cp chunks (rank i holds chunks i and 2cp - 1 - i, which balances causal
    attention), each rank's share again over tensor-parallel ranks under sequence parallelism."""
    cp, tp = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    require(len(parallel.cp_comm_type) in (1, model.num_layers),
             f"--cp-comm-type takes one value for every layer or one per layer ({model.num_layers}), got "
             f"{len(parallel.cp_comm_type)}.")
    if cp == 1:
        return
    require(model.seq_length % (2 * cp) == 0,
             f"--context-parallel-size {cp} splits each sequence into 2 x {cp} = {2 * cp} equal chunks (rank i holds "
             f"chunks i and {2 * cp - 1} - i, which balances causal attention): --seq-length ({model.seq_length}) must "
             f"be divisible by {2 * cp}.")
    require(not parallel.sequence_parallel or (model.seq_length // cp) % tp == 0,
             f"--sequence-parallel splits each context-parallel rank's {model.seq_length // cp} positions over "
             f"--tensor-model-parallel-size ({tp}) ranks: make --seq-length divisible by {cp} x {tp}.")
    require("p2p" not in parallel.cp_comm_type or model.attention_dropout == 0,
             f"--cp-comm-type p2p computes attention block by block without keeping the probabilities, so it has no "
             f"attention dropout: give --attention-dropout 0 (--attention-dropout {model.attention_dropout} now; "
             f"Megatron-LM's default is 0.1), or --cp-comm-type all_gather.")


def _check_linear_attention_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Gated DeltaNet layers split their key heads (each with its value heads) over tensor-parallel ranks, and
    have no context parallelism: a rank's chunk of the sequence would need the recurrent state at its start,
    which only the ranks before it can compute (docs/model_families.md, "Qwen3-Next, Qwen3.5 and gated DeltaNet")."""
    if model.experimental_attention_variant is None:
        return
    tp = parallel.tensor_model_parallel_size
    require(model.linear_num_key_heads % tp == 0,
            f"--linear-num-key-heads ({model.linear_num_key_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole gated DeltaNet key heads.")
    require(parallel.context_parallel_size == 1,
            f"--context-parallel-size {parallel.context_parallel_size} with --experimental-attention-variant gdn: "
            f"a gated DeltaNet layer's scan carries a state from each position to the next, so a rank's chunk of "
            f"the sequence cannot start before the ranks ahead of it finish; use --context-parallel-size 1.")


def _check_expert_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_size
    if model.num_experts is None:
        require(ep == 1, "--expert-model-parallel-size splits the experts of mixture-of-experts layers: add "
                          "--num-experts N, or drop it.")
        return
    require(model.num_experts % ep == 0,
             f"--num-experts ({model.num_experts}) must be divisible by --expert-model-parallel-size ({ep}): each "
             f"expert-parallel rank holds the same number of experts.")
    require(model.moe_ffn_hidden_size % etp == 0,
             f"--moe-ffn-hidden-size ({model.moe_ffn_hidden_size}) must be divisible by the expert-tensor-parallel "
             f"size ({etp}, --expert-tensor-parallel-size, default --tensor-model-parallel-size).")
    tp = parallel.tensor_model_parallel_size
    require(not model.add_bias_linear or etp in (1, tp),
            f"the experts' biases (--add-bias-linear) are split as their weights only over the tensor-parallel "
            f"ranks: --expert-tensor-parallel-size must be 1 or --tensor-model-parallel-size ({tp}), got {etp}.")
    shared = model.moe_shared_expert_intermediate_size
    require(shared is None or shared % parallel.tensor_model_parallel_size == 0,
             f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by --tensor-model-parallel-size "
             f"({parallel.tensor_model_parallel_size}): the shared expert is split as a dense MLP.")


def _check_expert_lora(model: ModelConfig, parallel: ParallelConfig, peft: PeftConfig) -> None:
    """LoRA on experts' linear_fc1 / linear_fc2 (each expert its own adapters) runs with the loop over experts and
    experts whole or split like the dense layers (their adapters' whole factors are summed over tensor ranks)."""
    mlp_targets = sorted({"linear_fc1", "linear_fc2"} & set(peft.lora_target_modules))
    if model.num_experts is None or peft.peft != "lora" or not mlp_targets:
        return
    require(not model.moe_grouped_gemm,
             f"--peft lora on experts ({' '.join(mlp_targets)}) adapts each expert's linears, which "
             f"--moe-grouped-gemm bypasses: drop --moe-grouped-gemm, or target linear_qkv linear_proj only.")
    etp, tp = parallel.expert_tensor_size, parallel.tensor_model_parallel_size
    require(etp in (1, tp), f"--peft lora on experts needs --expert-tensor-parallel-size 1 or the tensor-parallel "
                             f"size ({tp}), got {etp}.")


def _check_schedule_units(training: TrainingConfig, optimizer: OptimizerConfig) -> None:
    """Megatron's rule: a run counts in iterations or in samples, and its LR schedule in the same unit."""
    if training.train_samples is None:  # --train-iters, or --train-epochs (counted into iterations)
        unit, other = "iters", "samples"
        given = {"--lr-decay-samples": optimizer.lr_decay_samples is not None,
                 "--lr-warmup-samples": optimizer.lr_warmup_samples > 0,
                 "--lr-wsd-decay-samples": optimizer.lr_wsd_decay_samples is not None}
    else:
        unit, other = "samples", "iters"
        given = {"--lr-decay-iters": optimizer.lr_decay_iters is not None,
                 "--lr-warmup-iters": optimizer.lr_warmup_iters > 0,
                 "--lr-wsd-decay-iters": optimizer.lr_wsd_decay_iters is not None}
    for flag, present in given.items():
        require(not present, f"{flag} counts {other}, but the run is given in {unit} (--train-{unit}): use "
                              f"{flag.replace(other, unit)} instead, or --train-{other}.")
    warmup_flag = f"--lr-warmup-{unit}"
    warmup = optimizer.lr_warmup_iters if unit == "iters" else optimizer.lr_warmup_samples
    require(optimizer.lr_warmup_fraction is None or warmup == 0,
             f"--lr-warmup-fraction and {warmup_flag} both set the warmup; give only one.")
    wsd_decay = optimizer.lr_wsd_decay_iters if unit == "iters" else optimizer.lr_wsd_decay_samples
    require(optimizer.lr_decay_style != "WSD" or (wsd_decay is not None and wsd_decay > 0),
             f"--lr-decay-style WSD anneals over the last --lr-wsd-decay-{unit} of the decay: give a positive "
             f"--lr-wsd-decay-{unit}.")


# Config's sections by field name (``cli/arguments.py`` makes one flag group of each).
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
            "optimizer": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
            "logging": LoggingConfig, "peft": PeftConfig, "grpo": GRPOConfig}


def section_values(values: dict, section) -> dict:
    """The entries of a flat field-name -> value dict that belong to the dataclass ``section``."""
    names = {f.name for f in dataclasses.fields(section)}
    return {k: v for k, v in values.items() if k in names}


def missing_model_flags(values: dict) -> list[str]:
    """The flags of the ModelConfig fields without a default that ``values`` (by field name) lacks."""
    return [flag_name(f.name) for f in dataclasses.fields(ModelConfig)
            if f.default is dataclasses.MISSING and f.name not in values]
