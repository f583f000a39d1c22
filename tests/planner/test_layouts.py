"""Enumeration: exactly the layouts pretraining can run, tensor parallelism inside a node by default."""
import collections
import dataclasses
import itertools

from megatron_lite.config import SHARDING_STRATEGIES, Config, ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.model.builder import build_model_chunk
from megatron_lite.pipeline_parallel.schedule_table import rank_schedule
from megatron_lite.planner.cluster import PRESETS, customise
from megatron_lite.planner.layouts import enumerate_layouts
from megatron_lite.process_groups.parallel_state import mock_parallel_state

MODEL = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
                    vocab_size=500)
GLOBAL_BATCH = 16


def _pretraining_accepts(tp: int, pp: int, vpp: int, micro_batch_size: int, world: int) -> bool:
    """Check the batch and build every pipeline stage's chunks and schedule as pretraining would, without
    processes (pretraining's start-up check of the micro-batch count comes before any schedule)."""
    try:
        config = Config(model=MODEL, parallel=ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, sequence_parallel=tp > 1),
            training=TrainingConfig(micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH))
        dp = config.parallel.data_parallel_size(world)
        m = config.training.num_microbatches(dp)
        config.parallel.check_interleaved_microbatches(m)
        for stage in range(pp):
            state = mock_parallel_state(stage * tp * dp, world, tp, pp)
            for chunk in range(vpp):
                build_model_chunk(config, state, pipeline_rank=stage, virtual_rank=chunk)
            rank_schedule(pp, stage, m, vpp)
        return True
    except ConfigError:
        return False


def _enumerated(cluster, **kwargs) -> collections.Counter:
    base = Config(model=MODEL, training=TrainingConfig(global_batch_size=GLOBAL_BATCH))
    return collections.Counter((layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                layout.virtual_pipeline_model_parallel_size, layout.micro_batch_size)
                               for layout in enumerate_layouts(base, cluster, **kwargs))


def test_exactly_the_layouts_pretraining_accepts():
    cluster = customise(PRESETS["h100-80g"], num_gpus=8)
    found = _enumerated(cluster)
    expected = {(tp, pp, vpp, mbs) for tp, pp, vpp, mbs in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], range(1, 9),
                                                                            [1, 2, 4, 8, 16])
                if _pretraining_accepts(tp, pp, vpp, mbs, 8)}
    assert set(found) == expected
    assert set(found.values()) == {3 * len(SHARDING_STRATEGIES)}  # every recomputation x strategy
    assert (2, 1, 1, 1) in found and (4, 1, 1, 1) not in found  # 4 heads but 2 key/value groups


def test_tensor_parallelism_stays_inside_a_node():
    cluster = customise(PRESETS["h100-80g"], num_gpus=8, gpus_per_node=2)
    assert {tp for tp, *_ in _enumerated(cluster)} == {1, 2}
    assert {tp for tp, *_ in _enumerated(cluster, tensor_parallel_across_nodes=True)} == {1, 2}  # heads cap tp at 2
    wide = dataclasses.replace(MODEL, num_query_groups=4)
    base = Config(model=wide, training=TrainingConfig(global_batch_size=GLOBAL_BATCH))
    tps = {layout.tensor_model_parallel_size
           for layout in enumerate_layouts(base, cluster, tensor_parallel_across_nodes=True)}
    assert tps == {1, 2, 4}


def test_enumerated_flags_are_consistent():
    cluster = customise(PRESETS["a100-80g"], num_gpus=8)
    base = Config(model=MODEL, parallel=ParallelConfig(overlap_grad_reduce=True),
                  training=TrainingConfig(global_batch_size=GLOBAL_BATCH, bf16=True))
    for layout in enumerate_layouts(base, cluster):
        parallel = layout.config.parallel
        assert parallel.sequence_parallel == (parallel.tensor_model_parallel_size > 1)
        assert parallel.use_distributed_optimizer == (layout.sharding_strategy != "no_shard")
        assert parallel.overlap_param_gather == parallel.use_distributed_optimizer
        assert layout.config.training.bf16 and layout.global_batch_size == GLOBAL_BATCH
