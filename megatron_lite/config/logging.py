"""LoggingConfig: the iteration line, TensorBoard and W&B, memory, throughput and straggler reports, and the
profiler."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.fields import check_choices, require


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
