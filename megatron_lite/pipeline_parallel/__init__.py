"""Pipeline parallelism: schedule tables, the executor that runs them, p2p exchange, layer split."""
from megatron_lite.pipeline_parallel.layer_split import get_layer_numbers
from megatron_lite.pipeline_parallel.schedule_table import ScheduleOp, build_schedule, rank_schedule
from megatron_lite.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)

__all__ = [
    "get_layer_numbers", "ScheduleOp", "build_schedule", "rank_schedule", "get_forward_backward_func",
    "forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
]
