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
    optimizer.py   OptimizerConfig
    __init__.py    the other sections, and Config, which checks the sections against each other
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.batch_size_schedule import parse_step_batch_size_schedule, schedule_in_samples
from megatron_lite.config.errors import ConfigError, UserError  # noqa: F401 (imported from here everywhere)
from megatron_lite.config.fields import (NEGATIVE_FLAGS, as_flags, check_choices, flag_is_on,  # noqa: F401
                                         flag_name, require)
from megatron_lite.config.model import (ATTENTION_BACKENDS, NORMALIZATIONS, POSITION_EMBEDDING_TYPES,  # noqa: F401
                                        ROPE_TYPES, YARN_DEFAULTS, ModelConfig, default_ffn_hidden_size)
from megatron_lite.config.optimizer import (LR_DECAY_STYLES, LR_WARMUP_STYLES, MUON_COEFFICIENT_TYPES,  # noqa: F401
                                            MUON_SCALE_MODES, WEIGHT_DECAY_INCR_STYLES, WSD_DECAY_STYLES,
                                            OptimizerConfig)
from megatron_lite.config.parallel import CP_COMM_TYPES, SHARDING_STRATEGIES, ParallelConfig  # noqa: F401
from megatron_lite.config.grpo import GRPO_LOSS_TYPES, GRPO_SCALE_REWARDS, GRPOConfig  # noqa: F401


# --rerun-mode and --error-injection-type (Megatron-LM's re-run state machine, training/rerun_state_machine.py).
RERUN_MODES = ("validate_results", "report_stats", "disabled")
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")

# --dpo-loss-type: the preference losses of training/dpo.py; the last two need no reference model.
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE_DPO_LOSS_TYPES = ("simpo", "orpo")

# The flags that give a run's length (one at most), and the length without any (Megatron-LM requires one).
RUN_LENGTH_FIELDS = ("train_iters", "train_samples", "train_epochs")
DEFAULT_TRAIN_ITERS = 100


@dataclass(kw_only=True)
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # default micro batch x data-parallel size
    # The run's length: iterations, or samples (Megatron's two ways), or passes over the training data (HF
    # Trainer's num_train_epochs, our own flag: Megatron has none), counted into iterations at start-up
    # (training/run_plan.py). None of them means DEFAULT_TRAIN_ITERS iterations.
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    train_epochs: Optional[float] = None
    # START INCREMENT SAMPLES: the global batch grows from START by INCREMENT, reaching
    # --global-batch-size after SAMPLES samples (Megatron's batch-size ramp-up).
    rampup_batch_size: Optional[list[int]] = field(
        default=None, metadata={"nargs": 3, "metavar": ("START", "INCREMENT", "SAMPLES")})
    # "THRESHOLD:BATCH ...": the global batch from THRESHOLD tokens consumed on (Megatron-Core 0.20's
    # replacement of the ramp-up; format in batch_size_schedule.py). Its last batch is the global batch.
    step_batch_size_schedule: Optional[str] = None
    calculate_per_token_loss: bool = False  # loss = sum over the global batch's tokens / their count
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    recompute_granularity: Optional[str] = field(default=None, metadata={"choices": ("full", "selective")})
    recompute_method: Optional[str] = field(default=None, metadata={"choices": ("uniform", "block")})
    recompute_num_layers: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_signal_handler: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    manual_gc: bool = False  # no automatic garbage collection: collect at the same iterations on every rank
    manual_gc_interval: int = 0  # with --manual-gc: collect every N iterations (0: only around evaluation)
    manual_gc_eval: bool = True
    # torch.cuda.empty_cache(): 1 after forward-backward, 2 also after the step.
    empty_unused_memory_level: int = field(default=0, metadata={"choices": (0, 1, 2)})
    check_for_nan_in_loss_and_grad: bool = True  # a non-finite loss or grad norm stops the run (training/nan_check.py)
    # A suspicious result (NaN, a spike) re-runs its iteration to tell a transient fault from a reproducible one.
    rerun_mode: str = field(default="validate_results", metadata={"choices": RERUN_MODES})
    check_for_spiky_loss: bool = False  # a loss 10x the largest of the first 100 is suspicious
    check_for_large_grads: bool = False  # the same for the grad norm
    error_injection_rate: int = 0  # inject a rejected result once every N validations (0: never)
    error_injection_type: str = field(default="transient_error", metadata={"choices": ERROR_INJECTION_TYPES})
    # Direct preference optimisation (--dpo, training/dpo.py): the loss of each (chosen, rejected) pair.
    dpo_loss_type: str = field(default="sigmoid", metadata={"choices": DPO_LOSS_TYPES})
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    dpo_simpo_gamma: float = 0.5  # SimPO's target reward margin (TRL's CPOConfig.simpo_gamma)
    dpo_cpo_alpha: float = 0.0  # SimPO: the weight of the chosen answers' NLL (TRL's cpo_alpha; CPO-SimPO)
    # One forward-only pass of the reference before training scores every pair the run reads; its copy is freed.
    dpo_precompute_ref_log_probs: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        lengths = [flag_name(name) for name in RUN_LENGTH_FIELDS if getattr(self, name) is not None]
        require(len(lengths) <= 1, f"{' and '.join(lengths)} are mutually exclusive: give the run's length once, "
                                    f"in iterations, samples or epochs.")
        if not lengths:
            self.train_iters = DEFAULT_TRAIN_ITERS
        require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}.")
        require(self.dpo_beta > 0, f"--dpo-beta must be positive, got {self.dpo_beta}.")
        require(0.0 <= self.dpo_label_smoothing < 0.5,
                 f"--dpo-label-smoothing must be in [0, 0.5), got {self.dpo_label_smoothing}.")
        require(self.dpo_cpo_alpha >= 0, f"--dpo-cpo-alpha must be >= 0, got {self.dpo_cpo_alpha}.")
        require(self.global_batch_size is None or self.global_batch_size >= 1,
                 f"--global-batch-size must be >= 1, got {self.global_batch_size}.")
        require(self.train_iters is None or self.train_iters >= 0,
                 f"--train-iters must be >= 0, got {self.train_iters}.")
        require(self.train_samples is None or self.train_samples > 0,
                 f"--train-samples must be positive, got {self.train_samples}.")
        require(self.train_epochs is None or self.train_epochs > 0,
                 f"--train-epochs must be positive, got {self.train_epochs}.")
        require(self.rampup_batch_size is None or len(self.rampup_batch_size) == 3,
                 f"--rampup-batch-size takes three numbers (START INCREMENT SAMPLES), got {self.rampup_batch_size}.")
        self._check_step_batch_size_schedule()
        require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive; pick one.")
        require(self.recompute_granularity == "full" or self.recompute_method is None,
                 "--recompute-method only applies with --recompute-granularity full.")
        require(self.eval_interval >= 1, f"--eval-interval must be >= 1, got {self.eval_interval}.")
        interval = self.check_weight_hash_across_dp_replicas_interval
        require(interval is None or interval >= 1,
                 f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got {interval}.")
        require(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
                 f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}.")
        require(self.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}.")
        require(self.error_injection_rate >= 0,
                 f"--error-injection-rate must be >= 0 (0: no injection), got {self.error_injection_rate}.")
        require(self.error_injection_rate == 0 or self.rerun_mode == "validate_results",
                 f"--error-injection-rate tests the re-run of a rejected result, which only --rerun-mode "
                 f"validate_results does (got {self.rerun_mode}): drop one of them.")

    def _check_step_batch_size_schedule(self) -> None:
        """The schedule's last batch is the global batch: --global-batch-size may repeat it (Megatron-LM's
        own 175B script does, which Megatron-LM itself rejects), never contradict it."""
        if self.step_batch_size_schedule is None:
            return
        require(self.rampup_batch_size is None,
                 "--step-batch-size-schedule and --rampup-batch-size both set the batch as the run goes; give "
                 "only one (Megatron-Core 0.20 replaced the ramp-up by the schedule).")
        last_batch = parse_step_batch_size_schedule(self.step_batch_size_schedule)[-1][1]
        require(self.global_batch_size in (None, last_batch),
                 f"--global-batch-size {self.global_batch_size} contradicts --step-batch-size-schedule, whose "
                 f"last batch ({last_batch}) is the global batch; drop --global-batch-size or make it {last_batch}.")
        self.global_batch_size = last_batch

    def step_schedule_in_samples(self, seq_length: int) -> list[tuple[int, int]] | None:
        """--step-batch-size-schedule as (threshold in samples, global batch) pairs; None without one."""
        if self.step_batch_size_schedule is None:
            return None
        return schedule_in_samples(parse_step_batch_size_schedule(self.step_batch_size_schedule), seq_length)

    @property
    def dpo_uses_reference(self) -> bool:
        """Whether --dpo's loss compares the policy with a reference model (simpo and orpo do not)."""
        return self.dpo_loss_type not in REFERENCE_FREE_DPO_LOSS_TYPES

    def global_batch(self, data_parallel_size: int) -> int:
        """Sequences per iteration (after any ramp-up); without --global-batch-size, one micro-batch per replica."""
        return self.global_batch_size or self.micro_batch_size * data_parallel_size

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Gradient-accumulation steps: global batch = micro batch x steps x data-parallel size."""
        global_batch = self.global_batch(data_parallel_size)
        per_step = self.micro_batch_size * data_parallel_size
        source = ("the last batch of --step-batch-size-schedule" if self.step_batch_size_schedule
                  else "--global-batch-size")
        require(global_batch % per_step == 0,
                 f"{source} ({global_batch}) must be divisible by --micro-batch-size "
                 f"({self.micro_batch_size}) x data-parallel size ({data_parallel_size}) = {per_step}.")
        return global_batch // per_step


# --sft-tokenizer-prompt-format: how a conversation becomes text (megatron_lite/data/sft/prompt_format.py).
SFT_PROMPT_FORMATS = ("plain", "chatml", "default")
# --sft-format: the records' shape, and the names --sft-data-keys NAME=COLUMN may read a column under
# (megatron_lite/data/sft/formats.py).
SFT_FORMATS = ("auto", "prompt_response", "messages", "alpaca", "sharegpt")
SFT_DATA_KEY_NAMES = ("prompt", "response", "messages", "instruction", "input", "output", "system", "history",
                      "conversations")
# --tokenizer-type values (megatron_lite/tokenizer/ builds each).
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "TikTokenizer",
                   "NullTokenizer")


@dataclass(kw_only=True)
class DataConfig:
    data_path: list = field(default_factory=list)  # [path] or [w1, path1, w2, path2, ...]
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: Optional[str] = field(default=None, metadata={"choices": TOKENIZER_TYPES})
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    # v1 or v2 pre-tokenisation; only TikTokenizer reads it.
    tiktoken_pattern: Optional[str] = field(default=None, metadata={"choices": ("v1", "v2")})
    tiktoken_num_special_tokens: int = 1000
    data_cache_path: Optional[str] = None
    mmap_bin_files: bool = True  # --no-mmap-bin-files reads .bin with file reads (for filesystems mmap is slow on)
    eod_mask_loss: bool = False
    num_workers: int = 0  # data-loader worker processes per rank (Megatron's default is 2)
    # Supervised fine-tuning: prompt/response or chat JSONL files (or preprocessed prefixes), one list per split.
    sft: bool = False
    train_data_path: list = field(default_factory=list)
    valid_data_path: list = field(default_factory=list)
    test_data_path: list = field(default_factory=list)
    sft_tokenizer_prompt_format: str = field(default="plain", metadata={"choices": SFT_PROMPT_FORMATS})
    sft_pack_sequences: bool = False
    sft_format: str = field(default="auto", metadata={"choices": SFT_FORMATS})  # per record, from its keys
    sft_data_keys: list = field(default_factory=list)  # NAME=COLUMN: read COLUMN as NAME (see SFT_DATA_KEY_NAMES)
    # Preference pairs {"prompt", "chosen", "rejected"} in the fine-tuning files: fine-tuning data, so --sft too.
    dpo: bool = False
    # Prompts {"prompt"} or {"messages"} to sample completions of and reward (GRPOConfig): fine-tuning data too.
    grpo: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        require(not (self.dpo and self.grpo), "--dpo and --grpo are two ways to train: give one.")
        self.sft = self.sft or self.dpo or self.grpo
        # Megatron reads only the numbers in --split, so a launcher's literal quotes ('99,1,0', as
        # Megatron-LM's Llama 3 example passes them) are harmless there; strip them here too.
        self.split = self.split.strip("'\"")
        if self.sft:
            self._check_sft()
        else:
            require(not (self.train_data_path or self.valid_data_path or self.test_data_path),
                     "--train-data-path/--valid-data-path/--test-data-path name fine-tuning data: add --sft "
                     "(pretraining reads --data-path with --split).")
            require(not self.sft_pack_sequences, "--sft-pack-sequences needs --sft.")
            require(self.sft_format == "auto" and not self.sft_data_keys,
                     "--sft-format and --sft-data-keys say how to read fine-tuning data: add --sft.")
            require(self.mock_data or bool(self.data_path),
                     "no training data: give --data-path PREFIX (from tools/preprocess_data.py) or --mock-data.")
        require(not (self.mock_data and self.data_path),
                 "--mock-data and --data-path both given: drop --mock-data to train on the data, or --data-path.")
        require(self.tokenizer_type is not None or not (self.vocab_file or self.merge_file or self.tokenizer_model),
                 "--vocab-file/--merge-file/--tokenizer-model need --tokenizer-type to say how to read them "
                 "(GPT2BPETokenizer for GPT-2's vocab.json and merges.txt).")
        require(not self.eod_mask_loss or self.tokenizer_type is not None,
                 "--eod-mask-loss needs --tokenizer-type (and its files) to know the end-of-document token.")
        require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}.")
        parts = self.split.replace("/", ",").split(",")
        require(all(p.strip().replace(".", "", 1).isdigit() for p in parts) and len(parts) <= 3,
                 f"--split must be up to three comma-separated weights like 969,30,1, got {self.split!r}.")

    def _check_sft(self) -> None:
        require(bool(self.train_data_path),
                 "--sft needs --train-data-path: JSONL of {\"prompt\", \"response\"} or {\"messages\"} lines, or a "
                 "prefix written by tools/preprocess_data.py --sft.")
        require(not (self.data_path or self.mock_data),
                 "--sft reads --train-data-path (and --valid-data-path, --test-data-path); "
                 "drop --data-path/--mock-data.")
        require(self.tokenizer_type is not None, "--sft needs --tokenizer-type (and its files): the data is text.")
        check_sft_data_keys(self.sft_data_keys)


def check_sft_data_keys(entries: list[str]) -> None:
    """--sft-data-keys NAME=COLUMN ...: each NAME one the record formats read; the tools with their own parser
    (evaluate, preprocess_data) check theirs here too."""
    for entry in entries:
        name, _, column = entry.partition("=")
        require(name in SFT_DATA_KEY_NAMES and bool(column),
                 f"--sft-data-keys takes NAME=COLUMN with NAME among {', '.join(SFT_DATA_KEY_NAMES)} "
                 f"(e.g. prompt=question), got {entry!r}.")


@dataclass(kw_only=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    pretrained_checkpoint: Optional[str] = None
    use_checkpoint_args: bool = False
    # Write checkpoints in a background thread while training goes on (checkpointing/async_save.py).
    async_save: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        require(not self.async_save or self.save is not None, "--async-save needs --save DIR to write to.")
        require(self.save_interval is None or self.save_interval >= 1,
                 f"--save-interval must be >= 1, got {self.save_interval}.")
        require(self.save_interval is None or self.save is not None,
                 "--save-interval needs --save DIR to know where to write checkpoints.")
        require(not self.use_checkpoint_args or bool(self.load or self.pretrained_checkpoint),
                 "--use-checkpoint-args needs --load or --pretrained-checkpoint: the checkpoint whose model to use.")
        # Saving into the base would point its latest at the fine-tune's checkpoints (a PEFT run's: adapters
        # only), so a later run from that base silently starts from them.
        require(not (self.save and self.pretrained_checkpoint
                      and os.path.realpath(self.save) == os.path.realpath(self.pretrained_checkpoint)),
                 f"--save {self.save} is the --pretrained-checkpoint directory: the fine-tune's checkpoints would "
                 f"replace the base as its latest. Give --save (and --load, to resume) a directory of their own.")


# --peft methods, and the linear layers --lora-target-modules may name (Megatron-Core's module names; the
# multi-latent attention ones after them).
PEFT_METHODS = ("lora", "adapter", "prefix")
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj",
                       "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


@dataclass(kw_only=True)
class PeftConfig:
    """Parameter-efficient fine-tuning: train small added weights, keep the base model frozen."""

    peft: Optional[str] = field(default=None, metadata={"choices": PEFT_METHODS})  # None: train every weight
    lora_rank: int = 8
    lora_alpha: float = 8.0  # the update is scaled by alpha / rank
    lora_dropout: float = 0.0
    # linear_qkv names multi-latent attention's query and key/value projections too (Config resolves it).
    lora_target_modules: list = field(default_factory=lambda: list(LORA_TARGET_MODULES[:4]),
                                      metadata={"choices": LORA_TARGET_MODULES})
    adapter_dim: int = 32
    prefix_length: int = 16
    prefix_projection_hidden_size: Optional[int] = None  # None: learn the prefixes directly
    # The command line refuses --peft with no checkpoint to start from (adapters on random frozen weights
    # learn nothing useful) unless this says it is meant (checkpointing/preflight.py).
    peft_without_base_checkpoint: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        require(self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}.")
        require(self.lora_alpha > 0, f"--lora-alpha must be positive, got {self.lora_alpha}.")
        require(0.0 <= self.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1), got {self.lora_dropout}.")
        require(len(self.lora_target_modules) == len(set(self.lora_target_modules)) > 0,
                 f"--lora-target-modules must name each module once, got {self.lora_target_modules}.")
        self.lora_target_modules = [m for m in LORA_TARGET_MODULES if m in self.lora_target_modules]  # one order
        require(self.adapter_dim >= 1, f"--adapter-dim must be >= 1, got {self.adapter_dim}.")
        require(self.prefix_length >= 1, f"--prefix-length must be >= 1, got {self.prefix_length}.")
        hidden = self.prefix_projection_hidden_size
        require(hidden is None or hidden >= 1, f"--prefix-projection-hidden-size must be >= 1, got {hidden}.")


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    # Weights & Biases, as Megatron-LM: a run is logged when --wandb-project is given (save dir default: --save/wandb).
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    wandb_entity: str = ""
    peak_tflops: Optional[float] = None  # per device; None = look up the device table
    log_memory: bool = True
    log_throughput: bool = False  # TFLOP/s per GPU in the iteration line, as Megatron
    log_straggler: bool = False  # each --log-interval: the ranks' step times, slowest and fastest named
    # A torch.profiler trace of iterations [start, end) into --tensorboard-dir, on --profile-ranks (all if none).
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choices(self)
        require(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}.")
        require(bool(self.wandb_project) or not (self.wandb_exp_name or self.wandb_save_dir or self.wandb_entity),
                 "--wandb-exp-name/--wandb-save-dir/--wandb-entity configure a W&B run, which --wandb-project "
                 "starts: add --wandb-project NAME.")
        require(not self.profile or self.tensorboard_dir is not None,
                 "--profile writes its trace into --tensorboard-dir: give --tensorboard-dir DIR.")
        require(not self.profile or 0 <= self.profile_step_start < self.profile_step_end,
                 f"--profile-step-start ({self.profile_step_start}) must be >= 0 and below --profile-step-end "
                 f"({self.profile_step_end}).")


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
        _check_warmup_before_decay(self.optimizer)

    def set_train_iters_from_epochs(self, train_iters: int) -> None:
        """--train-epochs, once counted into iterations at start-up, becomes --train-iters: the LR schedule's
        default decay, the checks and a saved config then read as if that had been given."""
        self.training.train_epochs, self.training.train_iters = None, train_iters
        if self.optimizer.lr_decay_iters is None:
            self.optimizer.lr_decay_iters = train_iters
        _check_warmup_before_decay(self.optimizer)

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


def lora_targets_of(model: ModelConfig) -> tuple[str, ...]:
    """The linear layers of ``model`` that --lora-target-modules may name."""
    if not model.multi_latent_attention:
        return LORA_TARGET_MODULES[:4]
    return (*_latent_projections(model), "linear_proj", "linear_fc1", "linear_fc2")


def _latent_projections(model: ModelConfig) -> tuple[str, ...]:
    """Multi-latent attention's query and key/value projections: what ``linear_qkv`` means there."""
    query = ("linear_q_down_proj", "linear_q_up_proj") if model.q_lora_rank is not None else ("linear_q_proj",)
    return (*query, "linear_kv_down_proj", "linear_kv_up_proj")


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
        targets = (targets - {"linear_qkv"}) | set(_latent_projections(model))
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
    require(model.attention_chunk_size is None,
            f"--context-parallel-size {cp} with --attention-chunk-size: the context-parallel attention does not "
            f"cut its blocks into chunks; use --context-parallel-size 1.")
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


def _check_warmup_before_decay(optimizer: OptimizerConfig) -> None:
    in_samples = optimizer.lr_decay_samples is not None
    decay = optimizer.lr_decay_samples if in_samples else optimizer.lr_decay_iters
    if decay is None:  # --train-epochs without --lr-decay-iters: checked once the epochs are counted
        return
    warmup = optimizer.lr_warmup_samples if in_samples else optimizer.lr_warmup_iters
    unit = "samples" if in_samples else "iters"
    require(warmup < decay or (warmup == 0 and decay == 0),
             f"--lr-warmup-{unit} ({warmup}) must be smaller than --lr-decay-{unit} ({decay}, default "
             f"--train-{unit}): lower the warmup or lengthen the decay.")


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

