"""Re-run an iteration whose result looks wrong, to tell a transient fault from a reproducible result
(Megatron-LM's re-run state machine: --rerun-mode, --error-injection-rate/-type, --check-for-spiky-loss,
--check-for-large-grads).

At a thousand GPUs a device that computes one wrong number (silent data corruption) is a matter of days, and
a NaN from one is indistinguishable from a diverged run, unless the iteration is computed again. After each
forward-backward, before anything reaches the weights, every rank validates its own results: its loss (last
pipeline stage: the mean over its micro-batches, before the data-parallel average, so the rank that produced
it is known) and the norm of the averaged gradients it will step on. A result is rejected when it is NaN or
Inf (fatal: --check-for-nan-in-loss-and-grad) or 10x the largest of the first 100 seen (not fatal:
--check-for-spiky-loss, --check-for-large-grads; Megatron-LM's factor and sample count). The ranks agree on
whether any rejected (one all-reduce of a slot per rank, the cost of the old NaN check); if one did, every rank
restores what the iteration changed (every random generator, the data iterator's position: the same
micro-batches are replayed) and runs it again:

- a different result: a transient fault; training goes on with the re-run's (correct) result;
- the same result, no longer rejected (an injected correct_result): nothing was wrong; training goes on;
- the same rejected result: reproducible. Not fatal (a spike in the data): logged, training goes on. Fatal:
  the run stops with an error naming the iteration, the rank, the check and the samples of the batch, after
  saving the state before the iteration (--save), and exits 17 (Megatron-LM's
  EXIT_CODE_FAILED_ON_RESULT_VALIDATION). Megatron-LM first exits 16 to have the job resumed from that
  checkpoint on other GPUs and re-runs the iteration there; here the error says to do that (a result that
  reproduces on other hardware is the model's or the data's, one that does not names a faulty device).

``report_stats`` re-runs every iteration and logs, every --log-interval, how often each result came out
identical and the largest relative difference (non-deterministic kernels); it never stops the run. ``disabled``
re-runs nothing; a NaN or Inf still stops the run (training/nan_check.py). Error injection
(--error-injection-rate N: a validation is rejected when ``(r + rank) % N == 0`` for ``r`` drawn from a generator
of its own seeded with --seed, so training's random numbers are the same with and without it) makes each path
testable: the injected type decides what the re-run finds.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_lite.checkpointing.rng import get_rng_state, set_rng_state
from megatron_lite.config import UserError
from megatron_lite.process_groups import collectives, failures
from megatron_lite.training.logger import print_rank_last
from megatron_lite.training.nan_check import check_for_nan_in_loss_and_grad

# Megatron-LM's: a value this many times the largest of the first SPIKE_SAMPLES values is a spike.
SPIKY_LOSS_FACTOR = 10
LARGE_GRADS_FACTOR = 10
SPIKE_SAMPLES = 100
# Relative differences a re-run may show and still reproduce (Megatron-LM's: the forward is deterministic;
# a backward may not be, e.g. flash attention's).
LOSS_TOLERANCE = 0.0
GRAD_NORM_TOLERANCE = 1e-3
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

# What a rank found, agreed over the ranks (larger is worse).
_SOUND, _TRANSIENT, _REPRODUCED, _REPRODUCED_FATAL = range(4)


class ResultValidationError(UserError, RuntimeError):
    """A rejected result came out the same when its iteration was re-run: the run stops."""

    exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION


class ResultRejected(Exception):
    """Raised on every rank when an iteration's rejected result reproduced on a fatal check, before anything
    reached the weights and with the random states as before the iteration: the loop may save that state.
    ``error`` is this rank's ResultValidationError (None where this rank's results were sound)."""

    def __init__(self, iteration: int, error: Optional[ResultValidationError]):
        super().__init__(f"iteration {iteration}: a rejected result reproduced")
        self.iteration = iteration
        self.error = error

    def raise_on_every_rank(self) -> None:
        """The lowest rank that saw it reports its error; the others raise FailedOnAnotherRank."""
        def raise_here():
            if self.error is not None:
                raise self.error
        failures.run_on_every_rank(raise_here, f"reproduce a sound result at iteration {self.iteration}")


class RerunDataIterator:
    """A micro-batch iterator that keeps the current iteration's micro-batches, to replay them on a re-run."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.kept: list = []
        self.replay_at: Optional[int] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.replay_at is not None:
            batch = self.kept[self.replay_at]
            self.replay_at += 1
            return batch
        batch = next(self.iterator)
        self.kept.append(batch)
        return batch

    def rewind(self) -> None:
        self.replay_at = 0

    def advance(self) -> None:
        """The iteration is done: forget its micro-batches."""
        self.kept, self.replay_at = [], None


def wrap_data_iterator(data_iterator):
    """``data_iterator`` (one, a list of one per model chunk, or None) wrapped for replay."""
    if isinstance(data_iterator, list):
        return [wrap_data_iterator(d) for d in data_iterator]
    return None if data_iterator is None else RerunDataIterator(data_iterator)


def _replay_iterators(data_iterator) -> list[RerunDataIterator]:
    if isinstance(data_iterator, list):
        return [d for d in data_iterator if d is not None]
    return [] if data_iterator is None else [data_iterator]


class SpikeDetector:
    """A value ``factor`` times the largest of the first ``samples`` finite ones (Megatron-LM's
    is_unexpectedly_large). NaN and Inf are the NaN check's, never a spike."""

    def __init__(self, factor: float, samples: int = SPIKE_SAMPLES):
        self.factor, self.samples = factor, samples
        self.seen, self.largest = 0, 0.0

    def is_spike(self, value: float) -> bool:
        return math.isfinite(value) and self.seen >= self.samples and abs(value) >= self.factor * self.largest

    def observe(self, value: float) -> None:
        if math.isfinite(value) and self.seen < self.samples:
            self.seen += 1
            self.largest = max(self.largest, abs(value))


class ErrorInjector:
    """Rejects a validation once every ``rate`` (--error-injection-rate) on average, from a generator of its own."""

    def __init__(self, rate: int, kind: str, seed: int, rank: int):
        self.rate, self.kind, self.rank = rate, kind, rank
        self.generator = random.Random(seed)

    def maybe_inject(self) -> Optional[str]:
        """The injected type (--error-injection-type) or None; one draw per iteration on every rank, so the ranks
        stay in step and one rank in ``rate`` is hit."""
        if self.rate <= 0:
            return None
        hit = (self.generator.randrange(self.rate) + self.rank) % self.rate == 0
        return self.kind if hit else None


@dataclasses.dataclass
class Check:
    """One validated result of this rank's iteration."""

    name: str
    value: float
    rejected: bool
    fatal: bool
    tolerance: float
    injected: Optional[str] = None  # --error-injection-type, when the rejection was injected


def relative_difference(a: float, b: float) -> float:
    """0 for the same value (NaN and NaN, Inf and Inf of one sign included), inf when only one is finite."""
    if not (math.isfinite(a) and math.isfinite(b)):
        same = (math.isnan(a) and math.isnan(b)) or a == b
        return 0.0 if same else math.inf
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))


def rank_samples(first_sample: int, num_microbatches: int, micro_batch_size: int, data_parallel_size: int,
                 data_parallel_rank: int) -> list[range]:
    """The training samples of each of this rank's micro-batches in an iteration that starts at ``first_sample``:
    each micro-batch step takes the next micro x data-parallel samples and rank r reads the r-th slice
    (data/data_samplers.py)."""
    step = micro_batch_size * data_parallel_size
    return [range(first_sample + m * step + data_parallel_rank * micro_batch_size,
                  first_sample + m * step + (data_parallel_rank + 1) * micro_batch_size)
            for m in range(num_microbatches)]


def _ranges(ranges: list[range]) -> str:
    """'8-11, 16-19': consecutive ranges joined."""
    merged: list[list[int]] = []
    for r in ranges:
        if merged and merged[-1][1] == r.start:
            merged[-1][1] = r.stop
        else:
            merged.append([r.start, r.stop])
    return ", ".join(f"{start}-{stop - 1}" if stop - start > 1 else f"{start}" for start, stop in merged)


@dataclasses.dataclass
class IterationBatch:
    """Where an iteration's global batch lies in the training data, for naming it."""

    iteration: int
    first_sample: int
    global_batch: int
    num_microbatches: int


class ReproducibilityStats:
    """--rerun-mode report_stats: per result, how many re-runs, how many identical, the largest difference."""

    def __init__(self):
        self.counts: dict = defaultdict(lambda: [0, 0, 0.0])

    def record(self, name: str, difference: float) -> None:
        entry = self.counts[name]
        entry[0] += 1
        entry[1] += int(difference == 0.0)
        entry[2] = max(entry[2], difference)

    def log(self, names: tuple, iteration: int) -> None:
        """One line for every rank's re-runs since the last: the counts summed, the largest difference's maximum."""
        device = collectives.reduction_device([dist.group.WORLD]) if dist.is_initialized() else torch.device("cpu")
        counts = torch.tensor([self.counts[n][:2] for n in names], dtype=torch.float64, device=device)
        largest = torch.tensor([self.counts[n][2] for n in names], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            collectives.all_reduce(counts, dist.group.WORLD)
            collectives.all_reduce(largest, dist.group.WORLD, op=dist.ReduceOp.MAX)
        parts = [f"{name} {int(identical)}/{int(total)} identical, largest relative difference {difference:.3E}"
                 for name, (total, identical), difference in zip(names, counts.tolist(), largest.tolist()) if total]
        if parts:
            print_rank_last(f" re-run statistics (--rerun-mode report_stats) up to iteration {iteration}: "
                            + " | ".join(parts))
        self.counts.clear()


class RerunStateMachine:
    """Runs each iteration's forward-backward, validates its results and re-runs it when one is rejected."""

    def __init__(self, training_config, parallel_state, *, has_loss_scaler: bool):
        self.mode = training_config.rerun_mode
        # Under fp16 the loss scaler owns NaN and Inf (it skips those steps) and the scale moves the grad norm.
        self.check_nan = training_config.check_for_nan_in_loss_and_grad and not has_loss_scaler
        self.check_grads = not has_loss_scaler
        self.spikes = {"loss": SpikeDetector(SPIKY_LOSS_FACTOR) if training_config.check_for_spiky_loss else None,
                       "grad norm": (SpikeDetector(LARGE_GRADS_FACTOR)
                                     if training_config.check_for_large_grads and self.check_grads else None)}
        self.parallel_state = parallel_state
        self.rank = failures.global_rank()
        self.injector = ErrorInjector(training_config.error_injection_rate, training_config.error_injection_type,
                                      training_config.seed, self.rank)
        self.micro_batch_size = training_config.micro_batch_size
        # Nothing to validate: the iteration runs once, with no collective of its own.
        self.validates = self.check_nan or any(self.spikes.values()) or self.injector.rate > 0
        self.stats = ReproducibilityStats()
        self.batch: Optional[IterationBatch] = None

    @property
    def replays_data(self) -> bool:
        """Whether an iteration may be re-run: its micro-batches are then kept until it is done."""
        return self.mode == "report_stats" or (self.mode == "validate_results" and self.validates)

    def begin_iteration(self, batch: IterationBatch) -> None:
        self.batch = batch

    def run(self, forward_backward: Callable[[], list], data_iterator, model_chunks) -> list:
        """``forward_backward()``'s losses for this iteration (a re-run's when there was one), its gradients in
        the buffers; raises ResultRejected on every rank when a rejected result reproduced on a fatal check."""
        if not self.replays_data:
            losses = forward_backward()
            if self.mode == "disabled" and self.check_nan:
                values = self._values(losses, model_chunks)
                check_for_nan_in_loss_and_grad(values.get("loss"), values.get("grad norm"), self.batch.iteration)
            return losses
        replay = _replay_iterators(data_iterator)
        rng_state = get_rng_state()
        losses = forward_backward()
        initial = self._checks(self._values(losses, model_chunks))
        if self.mode == "report_stats":
            losses, again = self._rerun(forward_backward, replay, rng_state, model_chunks)
            for check in initial:
                self.stats.record(check.name, relative_difference(check.value, again[check.name]))
        else:
            losses = self._validate(initial, losses, forward_backward, replay, rng_state, model_chunks)
        for iterator in replay:
            iterator.advance()
        return losses

    def log_statistics(self, iteration: int) -> None:
        if self.mode == "report_stats":
            self.stats.log(("loss", "grad norm"), iteration)

    def _validate(self, initial: list[Check], losses, forward_backward, replay, rng_state, model_chunks):
        injected = self.injector.maybe_inject()
        if injected is not None and initial:  # on the first result this rank checks, standing for a NaN
            initial[0].rejected, initial[0].injected = True, injected
            initial[0].fatal = initial[0].fatal or self.check_nan
        rejected = [check for check in initial if check.rejected]
        if max(self._agree(_TRANSIENT if rejected else _SOUND)) == _SOUND:
            for name, value in ((c.name, c.value) for c in initial):
                if self.spikes.get(name) is not None:
                    self.spikes[name].observe(value)
            return losses
        for check in rejected:
            print(f" iteration {self.batch.iteration}: rank {self.rank}: the {check.name} {check.value} is rejected "
                  f"({self._why(check)}); re-running the iteration from the same state and micro-batches",
                  flush=True)
        losses, again = self._rerun(forward_backward, replay, rng_state, model_chunks)
        verdict, fatal_check = self._judge(rejected, again)
        verdicts = self._agree(verdict)
        if max(verdicts) == _REPRODUCED_FATAL:
            set_rng_state(*rng_state)  # as before the iteration, so a save of that state resumes it exactly
            error = self._error(fatal_check, again[fatal_check.name]) if fatal_check is not None else None
            raise ResultRejected(self.batch.iteration, error)
        return losses

    def _judge(self, rejected: list[Check], again: dict):
        """(verdict, the fatal check that reproduced or None) of this rank's rejected checks after the re-run."""
        verdict, fatal_check = _SOUND, None
        for check in rejected:
            value = again[check.name]
            differs = relative_difference(check.value, value) > check.tolerance
            if check.injected is not None:  # the injected type is what the re-run finds
                differs = check.injected == "transient_error"
            rejected_again = not differs and (check.injected == "persistent_error" or self._rejects(check.name, value))
            if differs:
                found, verdict = "differs: a transient fault; training goes on with the re-run's result", \
                    max(verdict, _TRANSIENT)
            elif not rejected_again:
                found = "reproduces a sound result: nothing was wrong; training goes on"
            elif not check.fatal:
                found, verdict = "reproduces it: a correct result (the model's or the data's); training goes on", \
                    max(verdict, _REPRODUCED)
            else:
                found, verdict, fatal_check = "reproduces it", _REPRODUCED_FATAL, fatal_check or check
            print(f" iteration {self.batch.iteration}: rank {self.rank}: the re-run's {check.name} {value} {found}",
                  flush=True)
        return verdict, fatal_check

    def _rerun(self, forward_backward, replay, rng_state, model_chunks):
        set_rng_state(*rng_state)
        for iterator in replay:
            iterator.rewind()
        losses = forward_backward()
        return losses, self._values(losses, model_chunks)

    def _values(self, losses: list, model_chunks) -> dict:
        """This rank's results: its loss (last stage; the mean of the main loss over its micro-batches) and
        the norm of the gradients it will step on (its shard under ZeRO; not under a loss scaler)."""
        values = {}
        if self.parallel_state.is_pipeline_last_stage() and losses:
            name = next(iter(losses[0]))
            total = torch.stack([entry[name].float() for entry in losses]).sum(dim=0)
            values["loss"] = (total[0] / total[1].clamp(min=1)).item()
        if self.check_grads:
            grads = [s.grad for chunk in model_chunks for s in chunk.param_slices()]
            if grads:
                norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
                values["grad norm"] = torch.linalg.vector_norm(norms).item()
        return values

    def _rejects(self, name: str, value: float) -> bool:
        spike = self.spikes.get(name)
        return (self.check_nan and not math.isfinite(value)) or (spike is not None and spike.is_spike(value))

    def _checks(self, values: dict) -> list[Check]:
        """The validated results, fatal (non-finite) rejections first."""
        checks = [Check(name, value, self._rejects(name, value), fatal=self.check_nan and not math.isfinite(value),
                        tolerance=LOSS_TOLERANCE if name == "loss" else GRAD_NORM_TOLERANCE)
                  for name, value in values.items()]
        return sorted(checks, key=lambda c: not (c.rejected and c.fatal))

    def _why(self, check: Check) -> str:
        if check.injected is not None and not self._rejects(check.name, check.value):
            return f"injected: --error-injection-type {check.injected}"
        if not math.isfinite(check.value):
            return "not finite"
        return f"a spike: over {self.spikes[check.name].factor}x the largest of the first {SPIKE_SAMPLES}"

    def _agree(self, verdict: int) -> list[int]:
        """Every rank's verdict (one all-reduce over the world of a slot per rank)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return [verdict]
        slots = torch.zeros(dist.get_world_size(), dtype=torch.int32,
                            device=collectives.reduction_device([dist.group.WORLD]))
        slots[dist.get_rank()] = verdict
        collectives.all_reduce(slots, dist.group.WORLD, op=dist.ReduceOp.MAX)
        return slots.tolist()

    def _error(self, check: Check, value: float) -> ResultValidationError:
        batch, ps = self.batch, self.parallel_state
        mine = rank_samples(batch.first_sample, batch.num_microbatches, self.micro_batch_size,
                            ps.data_parallel_world_size, ps.data_parallel_rank)
        where = (f"data-parallel rank {ps.data_parallel_rank}, pipeline stage {ps.pipeline_model_parallel_rank}, "
                 f"tensor-parallel rank {ps.tensor_model_parallel_rank}")
        return ResultValidationError(
            f"iteration {batch.iteration}: the {check.name} is {value} on rank {self.rank} ({where}; "
            f"{self._why(check)}), and again "
            f"when the iteration was re-run from the same state on the same micro-batches (training samples "
            f"{_ranges([range(batch.first_sample, batch.first_sample + batch.global_batch)])}; this rank's "
            f"{_ranges(mine)}): a reproducible result, not a transient fault. Either training diverged (lower "
            f"--lr, add warm-up (--lr-warmup-iters) or --clip-grad, or check those samples) or rank {self.rank}'s "
            f"device computes wrongly every time (resume from the checkpoint before iteration {batch.iteration} on "
            f"other nodes: a sound result there names this device). The run stops before the iteration reaches "
            f"the weights (exit code {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}); --no-check-for-nan-in-loss-and-grad "
            f"trains on regardless.")
