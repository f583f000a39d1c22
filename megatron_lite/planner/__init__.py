"""The parallelism planner: memory per GPU and step time of any layout on any cluster, before running it.

One module per model: ``cluster`` (presets) and ``calibrate`` (``--cluster local``);
``parameters`` (what each chunk holds), ``static_memory`` (parameters, gradients and
optimizer state per sharding strategy), ``activations`` (what a layer keeps for
backward), ``pipeline`` (bubble and in-flight micro-batches from the schedule tables),
``memory`` (the sum per rank), ``step_time``; ``layouts`` (what to try), ``estimate``
(one layout on one cluster) and ``report`` (text and JSON). ``megatron_lite/plan.py`` is
the command.

The training loop prints the estimate for its own layout beside the measured bytes:

    print_rank_last(planner.format_memory_estimate(
        planner.estimate_for_config(config, world_size, rank=world_size - 1), optimizer.memory_report()))
"""
from megatron_lite.planner.estimate import Estimate, estimate, estimate_for_config, format_memory_estimate

__all__ = ["Estimate", "estimate", "estimate_for_config", "format_memory_estimate"]
