"""TrainingConfig: the run's length and batch, precision, recomputation, evaluation, exits, the re-run
state machine and the preference loss."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.batch_size_schedule import parse_step_batch_size_schedule, schedule_in_samples
from megatron_lite.config.fields import check_choices, flag_name, require


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
