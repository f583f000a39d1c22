"""How many samples an iteration takes, and how many iterations a run has.

The global batch is a step function of the samples consumed so far (Megatron's num-microbatches
calculator): a schedule of (threshold in samples, batch) pairs, the batch at ``consumed`` being that
of the last threshold <= consumed. Three flags give the schedule:

- none: one step, ``--global-batch-size``;
- ``--step-batch-size-schedule "0:16 2.4B:320 ..."`` (Megatron-Core 0.20): the steps as written,
  thresholds in tokens divided by --seq-length;
- ``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-LM before 0.20, which now ignores it): the
  batch starts at START and grows by INCREMENT every ``SAMPLES / increments`` consumed samples,
  reaching ``--global-batch-size`` once SAMPLES are consumed::

    increments = (global_batch_size - START) // INCREMENT
    global batch(consumed) = global_batch_size                                 if consumed > SAMPLES
                           = START + INCREMENT * int(consumed / (SAMPLES / increments))   otherwise

  (``_rampup_schedule`` finds where each step begins under that exact float formula).

Micro-batches per iteration = global batch / (micro batch x data-parallel size). Being a pure
function of ``consumed_train_samples``, a resumed run follows the uninterrupted run's batches. As in
Megatron, only the batches still ahead must split evenly over the replicas (``check_batches_ahead``):
a run may resume on more GPUs once its small early batches are behind it.
"""
from __future__ import annotations

import bisect
import math
from typing import Optional

from megatron_lite.config import Config, ConfigError, TrainingConfig


class NumMicroBatchesCalculator:
    """The global batch and the micro-batch count at any point of the run.

    Args:
        global_batch_size: sequences per iteration after the ramp-up (the schedule's last batch).
        micro_batch_size: sequences per micro-batch on one data-parallel rank.
        data_parallel_size: data-parallel replicas.
        rampup_batch_size: (START, INCREMENT, SAMPLES), or None.
        step_batch_size_schedule: (threshold in samples, batch) pairs sorted by threshold, the first 0, or None.
    """

    def __init__(self, *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[list[int]] = None,
                 step_batch_size_schedule: Optional[list[tuple[int, int]]] = None) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.per_step = micro_batch_size * data_parallel_size
        self.rampup_batch_size = rampup_batch_size
        self.is_step_schedule = step_batch_size_schedule is not None
        if self.is_step_schedule:
            self.schedule = list(step_batch_size_schedule)
        elif rampup_batch_size is not None:
            _check_rampup(global_batch_size, *rampup_batch_size)
            self.schedule = _rampup_schedule(global_batch_size, *rampup_batch_size)
        else:
            self.schedule = [(0, global_batch_size)]
        self.thresholds = [threshold for threshold, _ in self.schedule]

    def _step(self, consumed_samples: int) -> int:
        """Index of the schedule step in force after ``consumed_samples``."""
        return bisect.bisect_right(self.thresholds, consumed_samples) - 1

    def get_current_global_batch_size(self, consumed_samples: int) -> int:
        return self.schedule[self._step(consumed_samples)][1]

    def get_num_microbatches(self, consumed_samples: int) -> int:
        return self.get_current_global_batch_size(consumed_samples) // self.per_step

    def check_batches_ahead(self, consumed_samples: int) -> None:
        """Every batch from ``consumed_samples`` on must split into whole micro-batches on every replica
        (Megatron checks the current batch each iteration; checking the rest up front fails before a step)."""
        for index in range(self._step(consumed_samples), len(self.schedule)):
            if self.schedule[index][1] % self.per_step:
                raise ConfigError(
                    f"{self._source(index)} must be divisible by --micro-batch-size ({self.micro_batch_size}) x "
                    f"data-parallel size ({self.data_parallel_size}) = {self.per_step}; change the batch sizes or "
                    f"the number of data-parallel ranks (a run may resume on more ranks once the batches they do "
                    f"not divide are behind it).")

    def _source(self, index: int) -> str:
        """The flag and value that give the schedule's step ``index``."""
        threshold, batch = self.schedule[index]
        if index == len(self.schedule) - 1 and not self.is_step_schedule:  # a ramp-up ends at the global batch
            return f"--global-batch-size ({batch})"
        flag = "--step-batch-size-schedule" if self.is_step_schedule else "--rampup-batch-size"
        return f"{flag}: the global batch {batch} (from {threshold} consumed samples on)"

    def microbatch_counts(self, consumed_samples: int = 0) -> list[int]:
        """Every micro-batch count the run uses from ``consumed_samples`` on, smallest first."""
        return sorted({batch // self.per_step for _, batch in self.schedule[self._step(consumed_samples):]})

    def consumed_samples_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        return self._run(iterations=iterations)[1]

    def iterations_to_reach(self, samples: int) -> int:
        """The fewest iterations whose batches hold at least ``samples`` samples (the last may pass it)."""
        return self._run(until=samples)[0]

    def iterations_for(self, train_samples: int) -> int:
        """The iterations a run of ``train_samples`` samples has (Megatron's update_train_iters).

        A step schedule (Megatron-Core 0.20) runs iterations while fewer than ``train_samples`` are
        consumed, so the last may pass it. The ramp-up rule (Megatron-LM before 0.20) runs ramp-up
        iterations while the samples consumed before them are within both the ramp-up and
        ``train_samples`` (the last one may pass it), then whole constant batches, a partial last batch dropped."""
        if self.is_step_schedule:
            return self._run(until=train_samples)[0]
        ramp_end = min(self.rampup_batch_size[2], train_samples) + 1 if self.rampup_batch_size else 0
        iterations, consumed = self._run(until=ramp_end)
        return iterations + max(train_samples - consumed, 0) // self.global_batch_size

    def _run(self, *, iterations: float = math.inf, until: float = math.inf) -> tuple[int, int]:
        """(iterations, consumed samples) of a run from the start that stops after ``iterations`` iterations
        or once ``until`` samples are consumed, whichever comes first. Counted a step at a time, not an
        iteration at a time: thresholds may lie billions of samples out."""
        done = consumed = 0
        for (_, batch), end in zip(self.schedule, self.thresholds[1:] + [math.inf]):
            samples = min(end, until) - consumed  # to consume at this step's batch
            steps = min(iterations - done, math.inf if samples == math.inf else max(-(-samples // batch), 0))
            done, consumed = done + steps, consumed + steps * batch
        return done, consumed


def _check_rampup(global_batch_size: int, start: int, increment: int, samples: int) -> None:
    if start <= 0 or increment <= 0 or samples <= 0:
        raise ConfigError(f"--rampup-batch-size START INCREMENT SAMPLES must all be positive, got "
                          f"{start} {increment} {samples}.")
    difference = global_batch_size - start
    if difference < 0 or difference % increment:
        raise ConfigError(f"--rampup-batch-size: --global-batch-size ({global_batch_size}) minus START "
                          f"({start}) must be a non-negative multiple of INCREMENT ({increment}).")


def _rampup_schedule(global_batch_size: int, start: int, increment: int, samples: int) -> list[tuple[int, int]]:
    """Megatron's ramp-up as steps. Step k (batch START + k x INCREMENT) begins at the first consumed count
    c <= SAMPLES with ``int(c / samples_per_increment) >= k`` (bisection over Megatron's own float formula),
    or at SAMPLES + 1 when the formula never reaches it: from there on the batch is the global one, which
    is the last step's."""
    increments = (global_batch_size - start) // increment
    if increments == 0:
        return [(0, global_batch_size)]
    samples_per_increment = samples / increments
    first_sample = {}
    for k in range(increments + 1):
        # When increments come faster than one per sample several share a first sample: the largest wins.
        begin = bisect.bisect_left(range(samples + 1), k, key=lambda consumed: int(consumed / samples_per_increment))
        first_sample[begin] = start + k * increment
    return sorted(first_sample.items())


def build_num_microbatches_calculator(config: Config, data_parallel_size: int) -> NumMicroBatchesCalculator:
    training = config.training
    return NumMicroBatchesCalculator(global_batch_size=training.global_batch(data_parallel_size),
                                     micro_batch_size=training.micro_batch_size,
                                     data_parallel_size=data_parallel_size,
                                     rampup_batch_size=training.rampup_batch_size,
                                     step_batch_size_schedule=training.step_schedule_in_samples(
                                         config.model.seq_length))


def get_train_iters(training: TrainingConfig, calculator: NumMicroBatchesCalculator) -> int:
    """--train-iters, or the iterations --train-samples takes under the batch schedule."""
    if training.train_iters is not None:
        return training.train_iters
    return calculator.iterations_for(training.train_samples)
