"""The distributed optimizer: ZeRO-1, optimizer state (and fp32 main parameters) sharded.

Gradients are reduce-scattered, but every rank still keeps the full gradient buffer
(only its shard is meaningful afterwards), so gradient memory is not sharded: this is
ZeRO-1, not ZeRO-2 (Megatron's ``--data-parallel-sharding-strategy optim``).

Each bucket of the data-parallel gradient buffer is split into dp equal shards;
rank r owns shard r of every bucket. It keeps fp32 main parameters and Adam
state only for the elements of its shards (a parameter cut by a shard boundary
contributes a slice to each side), so optimizer memory per rank is the unsharded
total / dp plus at most the padding that made buckets divisible by dp.

    backward: reduce-scatter each bucket -> this rank holds the averaged grads of its shard
    step:     clip by the norm over all shards (summed over the data-parallel group too),
              Adam on the shard, copy into the model's flat parameter buffer
    then:     all-gather each bucket's parameters (overlapped with the next forward
              under --overlap-param-gather)

Adam is element-wise, so updating slices gives exactly the unsharded result.
"""
from __future__ import annotations

from megatron_lite.process_groups import collectives
from megatron_lite.optimizer.optimizer import MegatronOptimizer, ParamRange


class DistributedOptimizer(MegatronOptimizer):
    """MegatronOptimizer over this rank's shard of every bucket (chunks built with
    --use-distributed-optimizer, so their buffers are sharded and padded)."""

    def _param_ranges(self, named_params: list) -> list[ParamRange]:
        names = {param: name for name, param in named_params}
        dp_group = self.parallel_state.data_parallel_group
        dp, dp_rank = collectives.world_size(dp_group), collectives.rank(dp_group)
        ranges = []
        for chunk in self.model_chunks:
            for buffer in chunk.grad_buffers:
                for bucket in buffer.buckets:
                    shard_size = bucket.numel // dp
                    shard_start = bucket.offset + dp_rank * shard_size
                    shard_end = shard_start + shard_size
                    for param in bucket.params:
                        start, end = buffer.param_index_map[param]
                        lo, hi = max(start, shard_start), min(end, shard_end)
                        if lo < hi:
                            ranges.append(ParamRange(names[param], param, lo - start, hi - start))
        return ranges

    def _data_parallel_group_for_grads(self):
        return self.parallel_state.data_parallel_group

    def _after_main_params_copied(self) -> None:
        for chunk in self.model_chunks:
            chunk.start_param_sync()
