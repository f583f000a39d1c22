"""How many samples an iteration takes, and how many iterations a run has.

The global batch is a function of the samples consumed so far (Megatron's num-microbatches
calculator). Without ``--rampup-batch-size`` it is constant. With
``--rampup-batch-size START INCREMENT SAMPLES`` it starts at START and grows by INCREMENT
every ``SAMPLES / ((global_batch_size - START) / INCREMENT)`` consumed samples, reaching
``--global-batch-size`` once SAMPLES are consumed:

    increments = (global_batch_size - START) // INCREMENT
    global batch(consumed) = global_batch_size                                 if consumed > SAMPLES
                           = START + INCREMENT * int(consumed / (SAMPLES / increments))   otherwise

Micro-batches per iteration = global batch / (micro batch x data-parallel size). Being a pure
function of ``consumed_train_samples``, a resumed run ramps exactly as the uninterrupted one.
"""
from __future__ import annotations

from typing import Optional

from megatron_lite.config import ConfigError, TrainingConfig


class NumMicroBatchesCalculator:
    """The global batch and the micro-batch count at any point of the run.

    Args:
        global_batch_size: sequences per iteration after the ramp-up.
        micro_batch_size: sequences per micro-batch on one data-parallel rank.
        data_parallel_size: data-parallel replicas.
        rampup_batch_size: (START, INCREMENT, SAMPLES) or None for a constant batch.
    """

    def __init__(self, *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[list[int]] = None) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.per_step = micro_batch_size * data_parallel_size
        self.start, self.increment, self.rampup_samples = rampup_batch_size or (global_batch_size, self.per_step, 0)
        self._check_divisible(global_batch_size, "--global-batch-size")
        if rampup_batch_size is not None:
            self._check_rampup()
        increments = (global_batch_size - self.start) // self.increment
        self.rampup_samples_per_increment = self.rampup_samples / increments if increments else None

    def _check_rampup(self) -> None:
        start, increment, samples = self.start, self.increment, self.rampup_samples
        if start <= 0 or increment <= 0 or samples <= 0:
            raise ConfigError(f"--rampup-batch-size START INCREMENT SAMPLES must all be positive, got "
                              f"{start} {increment} {samples}.")
        difference = self.global_batch_size - start
        if difference < 0 or difference % increment:
            raise ConfigError(f"--rampup-batch-size: --global-batch-size ({self.global_batch_size}) minus START "
                              f"({start}) must be a non-negative multiple of INCREMENT ({increment}).")
        # Every ramp-up batch (START + k x INCREMENT) must split into whole micro-batches on every replica.
        self._check_divisible(start, "--rampup-batch-size START")
        self._check_divisible(increment, "--rampup-batch-size INCREMENT")

    def _check_divisible(self, batch: int, flag: str) -> None:
        if batch % self.per_step:
            raise ConfigError(f"{flag} ({batch}) must be divisible by --micro-batch-size ({self.micro_batch_size}) "
                              f"x data-parallel size ({self.data_parallel_size}) = {self.per_step}.")

    def get_current_global_batch_size(self, consumed_samples: int) -> int:
        if self.rampup_samples_per_increment is None or consumed_samples > self.rampup_samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start + steps * self.increment

    def get_num_microbatches(self, consumed_samples: int) -> int:
        return self.get_current_global_batch_size(consumed_samples) // self.per_step

    def microbatch_counts(self) -> list[int]:
        """Every micro-batch count the run will use, ramp-up included, smallest first."""
        return list(range(self.start // self.per_step, self.global_batch_size // self.per_step + 1,
                          self.increment // self.per_step))

    def consumed_samples_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed = 0
        for done in range(iterations):
            batch = self.get_current_global_batch_size(consumed)
            if batch == self.global_batch_size:  # the ramp-up is over: constant from here on
                return consumed + (iterations - done) * batch
            consumed += batch
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """The iterations a run of ``train_samples`` samples has (Megatron's update_train_iters).

        Ramp-up iterations are counted while the samples consumed before them are within both the
        ramp-up and ``train_samples`` (the last one may pass it); then whole constant batches, a
        partial last batch dropped."""
        iterations = consumed = 0
        if self.rampup_samples_per_increment is not None:
            while consumed <= self.rampup_samples and consumed <= train_samples:
                consumed += self.get_current_global_batch_size(consumed)
                iterations += 1
        return iterations + max(train_samples - consumed, 0) // self.global_batch_size


def build_num_microbatches_calculator(training: TrainingConfig, data_parallel_size: int) -> NumMicroBatchesCalculator:
    return NumMicroBatchesCalculator(global_batch_size=training.global_batch(data_parallel_size),
                                     micro_batch_size=training.micro_batch_size,
                                     data_parallel_size=data_parallel_size,
                                     rampup_batch_size=training.rampup_batch_size)


def get_train_iters(training: TrainingConfig, calculator: NumMicroBatchesCalculator) -> int:
    """--train-iters, or the iterations --train-samples takes under the batch schedule."""
    if training.train_iters is not None:
        return training.train_iters
    return calculator.iterations_for(training.train_samples)
