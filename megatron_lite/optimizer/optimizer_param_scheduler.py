"""Learning-rate warmup and decay, and weight-decay increment, with Megatron-LM's formulas.

    step <= warmup:            lr = init_lr + (max_lr - init_lr) * step / warmup   (init_lr: --lr-warmup-init)
                               log warmup (DeepSpeed's WarmupLR default, --lr-warmup-style log), in iterations
                               i = step / samples_per_iteration and W = warmup / samples_per_iteration:
                               lr = init_lr + (max_lr - init_lr) * ln(max(i, 1)) / ln(W), W >= 2
                               (DeepSpeed's ln(1 + n) / ln(W) at its scheduler count n = i - 1: its engine
                               steps the scheduler after each optimizer step, so iteration i runs at n = i - 1
                               and iterations 0 and 1 both at init_lr)
    warmup < step <= decay:    lr = min_lr + (max_lr - min_lr) * coeff(ratio),
                               ratio = (step - warmup) / (decay - warmup)
                               linear: coeff = 1 - ratio
                               cosine: coeff = 0.5 * (cos(pi * ratio) + 1)
                               WSD (warmup, stable, decay): coeff = 1 until the last wsd_decay steps before
                                   decay, then the --lr-wsd-decay-style curve of r = their elapsed fraction:
                                   linear 1 - r, cosine 0.5 * (cos(pi * r) + 1), exponential 2 * 0.5^r - 1,
                                   minus_sqrt 1 - sqrt(r)
                               inverse-square-root: lr = max(min_lr, max_lr * sqrt(max(warmup, 1) / max(step, 1)))
    step > decay:              lr = min_lr
    constant style:            lr = max_lr after warmup

``step`` is what ``step(increment)`` has added up. The training loop counts samples, as
Megatron-LM does: each iteration adds its global batch size, and iteration-based flags are
converted (``--lr-decay-iters`` x global batch size), so a batch-size ramp-up moves the
schedule by the samples actually consumed. The scheduler is created before the first
iteration, which therefore runs at step 0: with warmup its learning rate is 0, as in Megatron-LM.

A param group may carry its own ``max_lr`` and ``min_lr`` (``--decoupled-lr`` and
``--decoupled-min-lr`` for the embedding and output layer): same warmup and decay shape,
its own end points.
"""
from __future__ import annotations

import math
from typing import Optional

from megatron_lite.config import (LR_DECAY_STYLES, LR_WARMUP_STYLES, WEIGHT_DECAY_INCR_STYLES, WSD_DECAY_STYLES,
                                  ConfigError)

# The annealing curves of --lr-decay-style WSD, each falling from 1 to 0 as its ratio goes from 0 to 1.
WSD_DECAY_COEFFICIENTS = {
    "linear": lambda ratio: 1.0 - ratio,
    "cosine": lambda ratio: 0.5 * (math.cos(math.pi * ratio) + 1.0),
    "exponential": lambda ratio: 2.0 * 0.5 ** ratio - 1.0,
    "minus_sqrt": lambda ratio: 1.0 - math.sqrt(ratio),
}
assert tuple(sorted(WSD_DECAY_COEFFICIENTS)) == tuple(sorted(WSD_DECAY_STYLES))
# The values a checkpoint must agree on for its step count to mean the same schedule.
_WARMUP_FLAGS = "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction"
_DECAY_FLAGS = "--lr-decay-iters/--lr-decay-samples"
_SCHEDULE_FIELDS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": _WARMUP_FLAGS,
                    "lr_decay_steps": _DECAY_FLAGS, "lr_decay_style": "--lr-decay-style",
                    "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                    "wd_incr_steps": "--train-iters/--train-samples", "wd_incr_style": "--weight-decay-incr-style",
                    "group_lrs": "--decoupled-lr/--decoupled-min-lr", "init_lr": "--lr-warmup-init",
                    "wsd_decay_steps": "--lr-wsd-decay-iters/--lr-wsd-decay-samples",
                    "lr_wsd_decay_style": "--lr-wsd-decay-style", "lr_warmup_style": "--lr-warmup-style",
                    "samples_per_iteration": "--global-batch-size (with --lr-warmup-style log)"}
_STEP_FIELDS = {"lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps"}
# What a checkpoint saved before these fields existed was trained with.
_LEGACY_VALUES = {"init_lr": 0.0, "wsd_decay_steps": None, "lr_wsd_decay_style": None, "lr_warmup_style": "linear",
                  "samples_per_iteration": None}


class OptimizerParamScheduler:
    """Sets ``lr`` (and optionally ``weight_decay``) on every param group of an optimizer.

    A group's ``lr`` is the schedule's value, between the group's ``max_lr`` and ``min_lr``
    (default: the scheduler's), times its ``lr_mult`` (default 1). Weight decay is
    left alone unless ``start_wd``/``end_wd`` are given; then a group's
    ``weight_decay`` is the schedule's value times its ``wd_mult`` (default 1; 0
    for groups that must not decay).

    Args:
        optimizer: anything with ``.param_groups``, a list of dicts.
        max_lr: peak learning rate (``--lr``).
        min_lr: final learning rate (``--min-lr``).
        lr_warmup_steps: steps of linear warmup from 0 (may be fractional: ``--lr-warmup-fraction``).
        lr_decay_steps: step at which decay reaches ``min_lr``, warmup included.
        lr_decay_style: one of LR_DECAY_STYLES (``--lr-decay-style``).
        init_lr: learning rate at step 0, where warmup starts (``--lr-warmup-init``).
        lr_warmup_style: one of LR_WARMUP_STYLES (``--lr-warmup-style``).
        samples_per_iteration: with 'log' warmup, the steps of one iteration (the global batch size): DeepSpeed's
            log counts optimizer steps, so it is not the same curve in samples.
        wsd_decay_steps: with 'WSD', the steps before ``lr_decay_steps`` over which it anneals.
        lr_wsd_decay_style: with 'WSD', the annealing curve, one of WSD_DECAY_COEFFICIENTS.
        start_wd, end_wd: weight decay at step 0 and from ``wd_incr_steps`` on.
        wd_incr_steps: steps over which weight decay goes from start to end;
            required unless ``wd_incr_style`` is 'constant'.
        wd_incr_style: 'constant' (start_wd must equal end_wd), 'linear' or 'cosine'.
    """

    def __init__(self, optimizer, *, max_lr: float, min_lr: float, lr_warmup_steps: float, lr_decay_steps: int,
                 lr_decay_style: str, start_wd: Optional[float] = None, end_wd: Optional[float] = None,
                 wd_incr_steps: Optional[int] = None, wd_incr_style: str = "constant", init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: Optional[str] = None,
                 lr_warmup_style: str = "linear", samples_per_iteration: Optional[int] = None):
        wsd, log_warmup = lr_decay_style == "WSD", lr_warmup_style == "log" and lr_warmup_steps > 0
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.init_lr = float(init_lr)
        # Only WSD reads these; others keep None so a checkpoint's schedule compares equal whatever the flags say.
        self.wsd_decay_steps = wsd_decay_steps if wsd else None
        self.lr_wsd_decay_style = lr_wsd_decay_style if wsd else None
        self.lr_warmup_style = lr_warmup_style
        self.samples_per_iteration = samples_per_iteration if log_warmup else None  # as above: only log reads it
        self._check_schedule(wsd=wsd, log_warmup=log_warmup)
        self.num_steps = 0
        self.step(increment=0)

    def _check_schedule(self, *, wsd: bool, log_warmup: bool) -> None:
        """Each argument in its range, and the warmup, WSD and weight-decay arguments consistent."""
        checks = [
            (self.lr_decay_style in LR_DECAY_STYLES,
             f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, got {self.lr_decay_style!r}."),
            (0.0 <= self.min_lr <= self.max_lr,
             f"--min-lr ({self.min_lr}) must be between 0 and --lr ({self.max_lr})."),
            (0.0 <= self.init_lr <= self.max_lr,
             f"--lr-warmup-init ({self.init_lr}) must be between 0 and --lr ({self.max_lr})."),
            (not wsd or (self.wsd_decay_steps is not None and self.wsd_decay_steps > 0),
             f"--lr-decay-style WSD anneals over --lr-wsd-decay-iters (or -samples): give a positive one, got "
             f"{self.wsd_decay_steps}."),
            (not wsd or self.lr_wsd_decay_style in WSD_DECAY_COEFFICIENTS,
             f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_COEFFICIENTS)}, got "
             f"{self.lr_wsd_decay_style!r}."),
            (self.lr_warmup_style in LR_WARMUP_STYLES,
             f"--lr-warmup-style must be one of {', '.join(LR_WARMUP_STYLES)}, got {self.lr_warmup_style!r}."),
            (not log_warmup or (self.samples_per_iteration or 0) > 0,
             "a log warmup counts iterations: give the scheduler samples_per_iteration (the global batch size)."),
            (not log_warmup or self.lr_warmup_steps >= 2 * (self.samples_per_iteration or 1),
             f"--lr-warmup-style log needs a warmup of at least 2 iterations (ln 1 = 0), got {self.lr_warmup_steps} "
             f"steps of {self.samples_per_iteration} samples: raise --lr-warmup-iters to 2 (DeepSpeed raises it "
             f"itself)."),
            (0 <= self.lr_warmup_steps < self.lr_decay_steps,
             f"the warmup ({_WARMUP_FLAGS}: {self.lr_warmup_steps} steps) must be >= 0 and shorter than the decay "
             f"({_DECAY_FLAGS}: {self.lr_decay_steps} steps): lower the warmup or lengthen the decay."),
        ] + self._weight_decay_checks()
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def _weight_decay_checks(self) -> list[tuple[bool, str]]:
        start_wd, end_wd, style = self.start_wd, self.end_wd, self.wd_incr_style
        checks = [
            (style in WEIGHT_DECAY_INCR_STYLES,
             f"--weight-decay-incr-style must be one of {', '.join(WEIGHT_DECAY_INCR_STYLES)}, got {style!r}."),
            ((start_wd is None) == (end_wd is None),
             "give both --start-weight-decay and --end-weight-decay, or neither."),
        ]
        if start_wd is not None and end_wd is not None:
            checks.append((0.0 <= start_wd <= end_wd, f"--start-weight-decay ({start_wd}) must be between 0 "
                                                      f"and --end-weight-decay ({end_wd})."))
            if style == "constant":
                checks.append((start_wd == end_wd, f"--weight-decay-incr-style constant needs "
                                                   f"--start-weight-decay ({start_wd}) equal to "
                                                   f"--end-weight-decay ({end_wd})."))
            else:
                checks.append((self.wd_incr_steps is not None and self.wd_incr_steps > 0,
                               f"--weight-decay-incr-style {style} needs a positive wd_incr_steps "
                               f"(--train-iters), got {self.wd_incr_steps}."))
        return checks

    def get_lr(self, param_group: Optional[dict] = None) -> float:
        """The learning rate at the current step for ``param_group``'s end points (default: the
        scheduler's), before the group's ``lr_mult``."""
        group = param_group or {}
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self._warmup_coefficient()
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            # Continuous with the warmup's end; max(..., 1) keeps step 0 finite when there is no warmup.
            return max(min_lr, max_lr * math.sqrt(max(self.lr_warmup_steps, 1)) / math.sqrt(max(self.num_steps, 1)))
        return min_lr + self._decay_coefficient() * (max_lr - min_lr)

    def _warmup_coefficient(self) -> float:
        """0 at step 0 rising to 1 at the end of warmup: linear in the steps, or DeepSpeed's log of the iterations."""
        if self.lr_warmup_style == "linear":
            return self.num_steps / self.lr_warmup_steps
        iteration = self.num_steps / self.samples_per_iteration
        return math.log(max(iteration, 1.0)) / math.log(self.lr_warmup_steps / self.samples_per_iteration)

    def _decay_coefficient(self) -> float:
        """1 at the end of warmup, 0 at ``lr_decay_steps``, shaped by the decay style."""
        if self.lr_decay_style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                return 1.0  # the stable phase
            ratio = (self.num_steps - anneal_start) / self.wsd_decay_steps
            return WSD_DECAY_COEFFICIENTS[self.lr_wsd_decay_style](ratio)
        decay_ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            return 1.0 - decay_ratio
        return 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)

    def get_wd(self) -> Optional[float]:
        """The weight decay at the current step, or None when the scheduler leaves it alone."""
        if self.start_wd is None:
            return None
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        incr_ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1.0 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        """Advance ``increment`` steps and write the new values into every param group."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    @property
    def group_lrs(self) -> list:
        """Each param group's (max_lr, min_lr): part of the schedule a checkpoint must agree on."""
        return [[group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)]
                for group in self.optimizer.param_groups]

    @group_lrs.setter
    def group_lrs(self, values: list) -> None:
        for group, (max_lr, min_lr) in zip(self.optimizer.param_groups, values):
            group["max_lr"], group["min_lr"] = max_lr, min_lr

    def state_dict(self) -> dict:
        state = {name: getattr(self, name) for name in _SCHEDULE_FIELDS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state_dict: dict, *, override: bool = False, use_checkpoint: bool = False) -> None:
        """Resume at the checkpoint's step. As in Megatron-LM the schedule must be the one this run was
        given, unless ``override`` (--override-opt_param-scheduler: keep this run's values, e.g. to
        extend a run) or ``use_checkpoint`` (--use-checkpoint-opt_param-scheduler: take the checkpoint's)."""
        if override and use_checkpoint:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                              "each other: keep this run's schedule or the checkpoint's, not both.")
        if use_checkpoint:
            for name in _SCHEDULE_FIELDS:
                setattr(self, name, _saved(state_dict, name, getattr(self, name)))
        elif not override:
            self._check_same_schedule(state_dict)
        self.num_steps = state_dict["num_steps"]
        self.step(increment=0)

    def _check_same_schedule(self, state_dict: dict) -> None:
        def values(name):
            unit = " samples" if name in _STEP_FIELDS else ""  # iteration flags count global batches of samples
            return f"checkpoint {_saved(state_dict, name)!r}{unit}, this run {getattr(self, name)!r}{unit}"
        differences = [f"{flag} ({values(name)})" for name, flag in _SCHEDULE_FIELDS.items()
                       if _saved(state_dict, name) != getattr(self, name)]
        if differences:
            raise ConfigError(
                f"the checkpoint's learning-rate schedule differs from this run's: {'; '.join(differences)}. "
                "Add --override-opt_param-scheduler to continue with this run's schedule (e.g. to extend "
                "--train-iters), --use-checkpoint-opt_param-scheduler to keep the checkpoint's, or give the "
                "checkpoint's values.")


def _saved(state_dict: dict, name: str, missing=None):
    """A schedule value of a checkpoint; one saved before the field existed had its legacy value."""
    return state_dict.get(name, _LEGACY_VALUES.get(name, missing))


def lr_decay_samples(config, global_batch_size: int) -> int:
    """The samples after which the LR stays at --min-lr: --lr-decay-samples, or --lr-decay-iters iterations of
    ``global_batch_size`` (as ``get_optimizer_param_scheduler`` counts them)."""
    if config.training.train_samples is not None:
        return config.optimizer.lr_decay_samples
    return config.optimizer.lr_decay_iters * global_batch_size


def get_optimizer_param_scheduler(optimizer, config, global_batch_size: int) -> OptimizerParamScheduler:
    """The schedule of ``config`` (a Config) in samples, as Megatron-LM builds it: iteration-based
    flags count ``global_batch_size`` (the batch after any ramp-up) samples per iteration, and
    ``--lr-warmup-fraction`` is that fraction of the decay.

    Under --step-batch-size-schedule that batch is the schedule's last. Megatron-Core 0.20 uses micro batch
    x data-parallel size there instead (it refuses --global-batch-size next to a schedule and defaults it), so
    its --lr-decay-iters would end long before that many iterations; we keep the flags' meaning on purpose."""
    training, opt = config.training, config.optimizer
    decay_steps = lr_decay_samples(config, global_batch_size)
    if training.train_samples is not None:
        warmup_steps, train_steps = opt.lr_warmup_samples, training.train_samples
        wsd_decay_steps = opt.lr_wsd_decay_samples
    else:
        warmup_steps = opt.lr_warmup_iters * global_batch_size
        train_steps = training.train_iters * global_batch_size
        wsd_decay_steps = None if opt.lr_wsd_decay_iters is None else opt.lr_wsd_decay_iters * global_batch_size
    if opt.lr_warmup_fraction is not None:
        warmup_steps = opt.lr_warmup_fraction * decay_steps
    return OptimizerParamScheduler(optimizer, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=warmup_steps,
                                   lr_decay_steps=decay_steps, lr_decay_style=opt.lr_decay_style,
                                   start_wd=opt.start_weight_decay, end_wd=opt.end_weight_decay,
                                   wd_incr_steps=None if opt.start_weight_decay is None else train_steps,
                                   wd_incr_style=opt.weight_decay_incr_style, init_lr=opt.lr_warmup_init,
                                   wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=opt.lr_wsd_decay_style,
                                   lr_warmup_style=opt.lr_warmup_style, samples_per_iteration=global_batch_size)
