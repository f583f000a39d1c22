"""The distributed optimizer: optimizer state (and fp32 main parameters) sharded over data-parallel
ranks (the data x context-parallel ranks, which reduce gradients together). That alone is ZeRO-1
(``--data-parallel-sharding-strategy optim``: gradients are reduce-scattered, but every rank still keeps
the full gradient buffer); the same optimizer is the optimizer side of ZeRO-2 and ZeRO-3
(``optim_grads``, ``optim_grads_params``), whose data-parallel wrapper keeps only gradient (and
parameter) shards.

Each bucket of the data-parallel gradient buffer is split into dp equal shards;
rank r owns shard r of every bucket. It keeps fp32 main parameters and Adam
state only for the elements of its shards (a parameter cut by a shard boundary
contributes a slice to each side), so optimizer memory per rank is the unsharded
total / dp plus at most the padding that made buckets divisible by dp.

    backward: reduce-scatter each bucket -> this rank holds the averaged grads of its shard
              (in place in a full gradient buffer under optim; in a shard-sized one under
              optim_grads and optim_grads_params, which keep no full gradients)
    step:     clip by the norm over all shards (summed over the data-parallel group too),
              Adam on the shard, copy into the model's parameters (this rank's part of the flat
              parameter buffer; its parameter shard under optim_grads_params)
    then:     all-gather each bucket's parameters (overlapped with the next forward
              under --overlap-param-gather); optim_grads_params gathers each unit when it runs

Adam is element-wise, so updating slices gives exactly the unsharded result.
"""
from __future__ import annotations

from megatron_lite.optimizer.optimizer import MegatronOptimizer


class DistributedOptimizer(MegatronOptimizer):
    """MegatronOptimizer over this rank's shard of every bucket (chunks built with a sharding
    strategy, so their ``param_slices()`` are shards)."""

    def _data_parallel_group_for_grads(self):
        return self.parallel_state.data_parallel_group_with_context

    def _expert_data_parallel_group_for_grads(self):
        return self.parallel_state.expert_data_parallel_group

    def _after_main_params_copied(self) -> None:
        for chunk in self.model_chunks:
            chunk.start_param_sync()
