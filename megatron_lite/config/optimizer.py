"""OptimizerConfig: the optimizer (Adam, SGD, Muon, Lion), its learning-rate and weight-decay schedules, and
gradient clipping and loss scaling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lite.config.fields import check_choices, require


# --lr-decay-style and --lr-wsd-decay-style values (Megatron-LM's); the formulas are in optimizer_param_scheduler.py.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
# --lr-warmup-style values: Megatron-LM's linear warmup, and DeepSpeed's log warmup (its WarmupLR default).
LR_WARMUP_STYLES = ("linear", "log")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_COEFFICIENT_TYPES = ("simple", "quintic")  # the sets in megatron_lite/optimizer/newton_schulz.py


@dataclass(kw_only=True)
class OptimizerConfig:
    optimizer: str = field(default="adam", metadata={"choices": ("adam", "sgd", "muon", "lion")})
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = field(default="linear", metadata={"choices": LR_DECAY_STYLES})
    # Warmup and decay in iterations (with --train-iters) or in samples (with --train-samples);
    # --lr-warmup-fraction gives the warmup as a fraction of the decay instead.
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # default train_iters
    lr_warmup_samples: int = 0
    lr_decay_samples: Optional[int] = None  # default train_samples
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_init: float = 0.0  # warmup rises from this to --lr
    lr_warmup_style: str = field(default="linear", metadata={"choices": LR_WARMUP_STYLES})  # ours, not Megatron's
    # --lr-decay-style WSD: stable at --lr, then anneals over the last iterations (or samples) of the decay.
    lr_wsd_decay_style: str = field(default="exponential", metadata={"choices": WSD_DECAY_STYLES})
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    decoupled_lr: Optional[float] = None  # the word embedding and output layer's own peak learning rate
    decoupled_min_lr: Optional[float] = None  # ... and final one (default --min-lr)
    weight_decay: float = 0.01
    start_weight_decay: Optional[float] = None  # with end_weight_decay: a weight-decay schedule
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = field(default="constant", metadata={"choices": WEIGHT_DECAY_INCR_STYLES})
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    # --optimizer muon (megatron_lite/optimizer/muon.py), Megatron-LM's flags and defaults.
    muon_momentum: float = 0.9
    muon_split_qkv: bool = True  # --muon-no-split-qkv: orthogonalise fused QKV (and SwiGLU's fc1) whole
    muon_nesterov: bool = False
    muon_scale_mode: str = field(default="spectral", metadata={"choices": MUON_SCALE_MODES})
    muon_fp32_matmul_prec: str = field(default="medium", metadata={"choices": ("low", "medium", "high")})
    muon_coefficient_type: str = field(default="quintic", metadata={"choices": MUON_COEFFICIENT_TYPES})
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = field(default="duplicated", metadata={"choices": ("blockwise", "duplicated", "distributed")})
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = field(default="adam", metadata={"choices": ("adam", "lion")})
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98
    clip_grad: float = 1.0
    loss_scale: Optional[float] = None  # static loss scale for fp16; None = dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    optimizer_cpu_offload: bool = False
    override_opt_param_scheduler: bool = False  # on resume, this run's LR schedule replaces the checkpoint's
    use_checkpoint_opt_param_scheduler: bool = False  # on resume, the checkpoint's LR schedule replaces this run's

    def __post_init__(self) -> None:
        check_choices(self)
        require(0 <= self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must be between 0 and --lr ({self.lr}).")
        require(0 <= self.lr_warmup_init <= self.lr,
                 f"--lr-warmup-init ({self.lr_warmup_init}) must be between 0 and --lr ({self.lr}).")
        require(self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}.")
        require(self.lr_warmup_samples >= 0, f"--lr-warmup-samples must be >= 0, got {self.lr_warmup_samples}.")
        require(self.lr_warmup_fraction is None or 0.0 <= self.lr_warmup_fraction < 1.0,
                 f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}.")
        require(self.decoupled_min_lr is None or self.decoupled_lr is not None,
                 "--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak learning rate).")
        decoupled_min_lr = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        require(self.decoupled_lr is None or 0 <= decoupled_min_lr <= self.decoupled_lr,
                 f"--decoupled-min-lr ({decoupled_min_lr}, default --min-lr) must be between 0 and "
                 f"--decoupled-lr ({self.decoupled_lr}).")
        require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}.")
        require(0.0 <= self.muon_momentum < 1.0, f"--muon-momentum must be in [0, 1), got {self.muon_momentum}.")
        require(self.optimizer != "muon" or not self.optimizer_cpu_offload,
                "--optimizer muon moves whole matrices between data-parallel ranks on the accelerator; drop "
                "--optimizer-cpu-offload (or use --optimizer adam).")
        require(self.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1, got {self.muon_num_ns_steps}.")
        require(self.muon_extra_scale_factor > 0,
                f"--muon-extra-scale-factor must be positive, got {self.muon_extra_scale_factor}.")
        for flag, beta in [("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2),
                           ("--lion-beta1", self.lion_beta1), ("--lion-beta2", self.lion_beta2)]:
            require(0.0 <= beta < 1.0, f"{flag} must be in [0, 1), got {beta}.")
        require(self.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}.")
        require(self.loss_scale is None or self.loss_scale > 0,
                 f"--loss-scale must be positive, got {self.loss_scale}.")
        require(self.hysteresis >= 1, f"--hysteresis must be >= 1, got {self.hysteresis}.")

    def check_warmup_before_decay(self) -> None:
        """The warmup ends before the decay does. Checked by Config, not here: the decay's default length is
        the run's (--train-iters or --train-samples, another section), or is known only once --train-epochs are
        counted into iterations."""
        in_samples = self.lr_decay_samples is not None
        decay = self.lr_decay_samples if in_samples else self.lr_decay_iters
        if decay is None:  # --train-epochs without --lr-decay-iters: checked once the epochs are counted
            return
        warmup = self.lr_warmup_samples if in_samples else self.lr_warmup_iters
        unit = "samples" if in_samples else "iters"
        require(warmup < decay or (warmup == 0 and decay == 0),
                f"--lr-warmup-{unit} ({warmup}) must be smaller than --lr-decay-{unit} ({decay}, default "
                f"--train-{unit}): lower the warmup or lengthen the decay.")
