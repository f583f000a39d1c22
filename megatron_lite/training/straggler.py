"""--log-straggler: which rank is slow, every --log-interval (Megatron-LM's straggler detector, in spirit).

In a synchronous job every rank's step takes as long as the slowest one's: the others wait for it inside
their collectives. So a rank's own speed is its step time minus the time it spent inside collectives
(``collectives.tracker``; the waits of asynchronous collectives, overlapped with compute, count as the
rank's own). The slowest rank has the most of it. Each interval the ranks all-gather two floats (the
interval's mean step time, and its mean time outside collectives) and the last rank prints the spread
with the slowest and fastest rank named.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.process_groups import collectives
from megatron_lite.training.logger import print_rank_last


class StragglerDetector:
    """Sums a rank's step times and the part of them outside collectives between two reports."""

    def __init__(self):
        self._start_interval()

    def _start_interval(self) -> None:
        self.steps = 0
        self.step_seconds = 0.0
        self.collective_seconds_at_start = collectives.tracker.seconds_in_collectives

    def record(self, step_seconds: float) -> None:
        self.steps += 1
        self.step_seconds += step_seconds

    def report(self, iteration: int) -> None:
        """Print the interval's spread (one all-gather over the world) and start the next interval."""
        waited = collectives.tracker.seconds_in_collectives - self.collective_seconds_at_start
        steps = max(self.steps, 1)
        mine = torch.tensor([self.step_seconds / steps, (self.step_seconds - waited) / steps], dtype=torch.float64)
        every = _all_gather(mine)
        self._start_interval()
        print_rank_last(format_straggler_report(iteration, every.tolist()))


def format_straggler_report(iteration: int, every: list[list[float]]) -> str:
    """``every[rank] = [mean step seconds, mean seconds outside collectives]``."""
    own = [outside for _, outside in every]
    slowest, fastest = max(range(len(own)), key=own.__getitem__), min(range(len(own)), key=own.__getitem__)
    steps = [step for step, _ in every]
    spread = own[slowest] / own[fastest] if own[fastest] > 0 else float("inf")
    return (f" straggler report at iteration {iteration}: step time {min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f} ms "
            f"over {len(every)} ranks | time outside collectives: slowest rank {slowest} {own[slowest] * 1e3:.1f} ms, "
            f"fastest rank {fastest} {own[fastest] * 1e3:.1f} ms, slowest/fastest {spread:.2f}")


def _all_gather(mine: torch.Tensor) -> torch.Tensor:
    """[world, 2]: every rank's two numbers."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine.unsqueeze(0)
    device = collectives.reduction_device([dist.group.WORLD])
    out = torch.empty(dist.get_world_size() * mine.numel(), dtype=mine.dtype, device=device)
    collectives.all_gather_into_tensor(out, mine.to(device), dist.group.WORLD)
    return out.view(-1, mine.numel()).cpu()
