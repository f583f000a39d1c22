"""The facts of a run, found once at start-up and handed to everything that reads them.

    plan_run(config, parallel_state) -> RunPlan
      the batch schedule (NumMicroBatchesCalculator) and the iterations it makes of --train-samples or
        --train-epochs (then written into the config as --train-iters, the LR schedule's unit)
      the model's parameter counts (one build of every pipeline stage on the meta device)
      the checkpoint the run starts from (checkpoint_to_load), with the --save/--load checks

The start-up summary, the checks of the batches ahead, the data iterators, the logger and the
checkpoint load all read the plan, so each question is answered once and every reader sees the
same answer (a second look at --load could see a checkpoint another job has just written).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lite.checkpointing.preflight import check_checkpoint_paths
from megatron_lite.config import Config, ConfigError, TrainingConfig
from megatron_lite.data.epoch_size import samples_per_epoch
from megatron_lite.model.builder import ParameterCounts, count_parameters
from megatron_lite.process_groups import failures
from megatron_lite.process_groups.parallel_state import ParallelState
from megatron_lite.training.num_microbatches_calculator import (NumMicroBatchesCalculator,
                                                                build_num_microbatches_calculator, get_train_iters)


@dataclass(frozen=True)
class RunPlan:
    calculator: NumMicroBatchesCalculator  # the global batch and micro-batch count at each consumed sample
    train_iters: int  # --train-iters, or the iterations --train-samples/--train-epochs take under the batch schedule
    parameters: ParameterCounts
    checkpoint: tuple[str, int, bool] | None  # checkpoint_to_load's (root, iteration, finetune); None: fresh
    length: str = ""  # how train_iters was found from --train-samples/--train-epochs ("" for --train-iters)

    @property
    def resumes(self) -> bool:
        """Whether the run continues a --load checkpoint's progress (a fine-tuning start begins at sample 0)."""
        return self.checkpoint is not None and not self.checkpoint[2]


def plan_run(config: Config, parallel_state: ParallelState) -> RunPlan:
    """The plan of ``config`` on this layout; every rank calls it (the checkpoint checks agree across ranks)."""
    calculator = build_num_microbatches_calculator(config, parallel_state.data_parallel_world_size)
    if config.training.train_epochs is not None:
        train_iters, length = failures.run_on_every_rank(lambda: iterations_of_epochs(config, calculator),
                                                         "count the samples of an epoch")
        config.set_train_iters_from_epochs(train_iters)
    else:
        train_iters, length = get_train_iters(config.training, calculator), _length_given(config.training)
    parameters = count_parameters(config)
    checkpoint = failures.run_on_every_rank(lambda: check_checkpoint_paths(config, parameters.total),
                                            "check the --save/--load directories")
    return RunPlan(calculator=calculator, train_iters=train_iters, length=length, parameters=parameters,
                   checkpoint=checkpoint)


def iterations_of_epochs(config: Config, calculator: NumMicroBatchesCalculator) -> tuple[int, str]:
    """(iterations, how they were found) for --train-epochs E: the fewest iterations whose batches (ramp-up and
    steps included) hold at least E passes' samples. The last batch may reach into the next pass, as HF
    Trainer's last step of an epoch is a partial batch; here batches stay whole, so no sample goes unseen."""
    epochs, per_epoch = config.training.train_epochs, samples_per_epoch(config)
    if per_epoch < 1:
        raise ConfigError(f"--train-epochs {epochs:g}: the training data holds no whole sample of --seq-length "
                          f"{config.model.seq_length}; add data or shorten --seq-length.")
    samples = math.ceil(epochs * per_epoch)
    iterations = calculator.iterations_to_reach(samples)
    return iterations, (f"--train-epochs {epochs:g} of {per_epoch:,} samples = {samples:,} samples, "
                        f"{calculator.consumed_samples_after(iterations):,} in whole batches")


def _length_given(training: TrainingConfig) -> str:
    """--train-iters needs no words (the command line notes when it is the default: cli/arguments.py)."""
    return f"--train-samples {training.train_samples:,}" if training.train_samples is not None else ""
