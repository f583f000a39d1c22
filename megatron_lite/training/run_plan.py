"""The facts of a run, found once at start-up and handed to everything that reads them.

    plan_run(config, parallel_state) -> RunPlan
      the batch schedule (NumMicroBatchesCalculator) and the iterations it makes of --train-samples
      the model's parameter counts (one build of every pipeline stage on the meta device)
      the checkpoint the run starts from (checkpoint_to_load), with the --save/--load checks

The start-up summary, the checks of the batches ahead, the data iterators, the logger and the
checkpoint load all read the plan, so each question is answered once and every reader sees the
same answer (a second look at --load could see a checkpoint another job has just written).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.checkpointing.preflight import check_checkpoint_paths
from megatron_lite.config import Config
from megatron_lite.model.builder import ParameterCounts, count_parameters
from megatron_lite.process_groups import failures
from megatron_lite.process_groups.parallel_state import ParallelState
from megatron_lite.training.num_microbatches_calculator import (NumMicroBatchesCalculator,
                                                                build_num_microbatches_calculator, get_train_iters)


@dataclass(frozen=True)
class RunPlan:
    calculator: NumMicroBatchesCalculator  # the global batch and micro-batch count at each consumed sample
    train_iters: int  # --train-iters, or the iterations --train-samples takes under the batch schedule
    parameters: ParameterCounts
    checkpoint: tuple[str, int, bool] | None  # checkpoint_to_load's (root, iteration, finetune); None: fresh

    @property
    def resumes(self) -> bool:
        """Whether the run continues a --load checkpoint's progress (a fine-tuning start begins at sample 0)."""
        return self.checkpoint is not None and not self.checkpoint[2]


def plan_run(config: Config, parallel_state: ParallelState) -> RunPlan:
    """The plan of ``config`` on this layout; every rank calls it (the checkpoint checks agree across ranks)."""
    calculator = build_num_microbatches_calculator(config, parallel_state.data_parallel_world_size)
    train_iters = get_train_iters(config.training, calculator)
    parameters = count_parameters(config)
    checkpoint = failures.run_on_every_rank(lambda: check_checkpoint_paths(config, parameters.total),
                                            "check the --save/--load directories")
    return RunPlan(calculator=calculator, train_iters=train_iters, parameters=parameters, checkpoint=checkpoint)
