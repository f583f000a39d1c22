"""Tensor and sequence parallelism: mappings, parallel layers, vocab-parallel loss, RNG tracker."""
from megatron_lite.tensor_parallel.config import TensorParallelConfig
from megatron_lite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_shards,
    set_tensor_model_parallel_attributes,
    shard_tensor,
)
from megatron_lite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_lite.tensor_parallel.replicated_linear import ReplicatedLinear
from megatron_lite.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_seed,
)

__all__ = [
    "TensorParallelConfig", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ReplicatedLinear",
    "gather_shards",
    "set_tensor_model_parallel_attributes", "shard_tensor",
    "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy", "RNGStatesTracker", "checkpoint", "get_rng_tracker", "model_parallel_seed",
]
