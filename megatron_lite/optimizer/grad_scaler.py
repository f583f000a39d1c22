"""Loss scaling for fp16 training.

fp16 has five exponent bits: small gradients underflow to zero. Multiplying the
loss by a large ``scale`` before backward lifts them into range; the optimizer
multiplies the gradients by ``inv_scale`` before using them. Too large a scale
overflows to inf/NaN instead, so the dynamic scaler lowers the scale when that
happens (the step is skipped) and raises it again after a run of clean steps.

bf16 has fp32's exponent range and needs no scaler.
"""
from __future__ import annotations

import torch

from megatron_lite.config import ConfigError


class MegatronGradScaler:
    """What both scalers share: the current ``scale`` and its reciprocal ``inv_scale``."""

    def __init__(self, scale: float):
        self._scale = torch.tensor(float(scale), dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # Reciprocal in float64 so 1/scale is the closest float32, not a twice-rounded one.
        return self._scale.double().reciprocal().float()


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, scale: float):
        if not scale > 0:
            raise ConfigError(f"--loss-scale must be positive, got {scale}.")
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows: the step is still skipped by the caller."""

    def state_dict(self) -> dict:
        # The scale comes from the command line, so there is nothing to resume.
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron-LM's dynamic loss scale (``--initial-loss-scale``, ``--min-loss-scale``,
    ``--loss-scale-window``, ``--hysteresis``).

    On an overflow the growth count restarts and the hysteresis budget shrinks by
    one; once it is spent, this and every further overflow multiplies the scale
    by ``backoff_factor`` (never below ``min_scale``). The budget is refilled only
    when the scale grows, i.e. after ``growth_interval`` consecutive clean steps,
    which multiply the scale by ``growth_factor``. Hysteresis keeps one stray
    overflow from halving a scale that is otherwise fine.
    """

    def __init__(self, *, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        checks = [
            (initial_scale > 0, f"--initial-loss-scale must be positive, got {initial_scale}."),
            (min_scale > 0, f"--min-loss-scale must be positive, got {min_scale}."),
            (min_scale <= initial_scale,
             f"--min-loss-scale ({min_scale}) must not exceed --initial-loss-scale ({initial_scale})."),
            (growth_factor > 1.0, f"growth_factor must be > 1, got {growth_factor}."),
            (0.0 < backoff_factor < 1.0, f"backoff_factor must be in (0, 1), got {backoff_factor}."),
            (growth_interval >= 1, f"--loss-scale-window must be >= 1, got {growth_interval}."),
            (hysteresis >= 1, f"--hysteresis must be >= 1, got {hysteresis}."),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        super().__init__(initial_scale)
        self.min_scale = torch.tensor(float(min_scale), dtype=torch.float32)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Record one step: ``found_inf`` must already agree on every rank (all-reduced MAX)."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.maximum(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = state_dict["scale"].detach().to(torch.float32).reshape(()).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
