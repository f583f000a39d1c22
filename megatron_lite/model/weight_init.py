"""Layout-independent weight initialisation.

Every FULL parameter is drawn from its own generator, seeded by (seed, parameter
name), and each rank keeps its tensor-parallel shard. A parameter with a
``full_init(shape, generator)`` attribute is drawn by it (the PEFT weights). Names are global (layers keyed
by global number), so the same seed gives the same full weights under any
tensor/pipeline layout, which is what lets equivalence tests compare layouts at all.
"""
import hashlib
import math

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.process_groups.parallel_state import ParallelState
from megatron_lite.tensor_parallel import shard_tensor

# Both copies of a tied embedding (first and last pipeline stage) are initialised, and checkpointed,
# under the embedding's name.
TIED_WEIGHT_NAME = "embedding.word_embeddings.weight"


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _init_full(name: str, param: nn.Parameter, shape: torch.Size, config: ModelConfig, seed: int) -> torch.Tensor:
    if hasattr(param, "full_init"):  # a parameter added on top of the model (PEFT) brings its own init
        return param.full_init(shape, _generator(seed, name))
    if name.endswith(("layernorm.weight", ".enorm.weight", ".hnorm.weight")):  # enorm, hnorm: multi-token prediction
        # --apply-layernorm-1p stores scale - 1: a scale of one either way.
        return torch.zeros(shape) if config.apply_layernorm_1p else torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = config.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        # Each layer adds two residual branches; scaling keeps the residual stream's variance flat in depth.
        std = std / math.sqrt(2.0 * config.num_layers)
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))


def full_shape(param: nn.Parameter, tensor_model_parallel_size: int, local_shape=None) -> torch.Size:
    """The whole (unsharded) shape of this rank's shard ``param``, from its tensor-parallel attributes.
    ``local_shape`` stands in for ``param.shape`` where the parameter is empty (ZeRO-3 between uses)."""
    shape = list(param.shape if local_shape is None else local_shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tensor_model_parallel_size
    return torch.Size(shape)


@torch.no_grad()
def initialize_weights(model_chunks: list[nn.Module], config: ModelConfig, parallel_state: ParallelState,
                       seed: int) -> None:
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            rank, size = parallel_state.tensor_split(param)  # expert weights: over the expert-tensor ranks
            init_name = TIED_WEIGHT_NAME if getattr(param, "shared_embedding", False) else name
            full = _init_full(init_name, param, full_shape(param, size), config, seed)
            if getattr(param, "tensor_model_parallel", False):
                full = shard_tensor(full, partition_dim=param.partition_dim, partition_stride=param.partition_stride,
                                    rank=rank, world_size=size)
            param.copy_(full)
