"""What a checkpoint holds of a run, and under which names: shared by ``saving`` and ``loading`` (and by
``offline``, which writes checkpoints from global tensors, and the interop converters).

A parameter is stored under its name in the model, the last stage's copy of the tied embedding under the
embedding's (``checkpoint_name``); its optimizer state under ``optimizer.<state>.<name>``; buffers that training
moves (a router's expert bias) beside the parameters. Every sharding strategy writes the same format: optimizer
state as each rank's flat ranges, weights whole or as flat ranges.

ZeRO-3 (optim_grads_params) keeps no whole weights: it is for models that do not fit whole
on one rank, so a save or load must not gather them. Each data-parallel rank writes the flat
slice of each weight its shard holds, exactly as the distributed optimizer writes its state
(a ``flat_range`` per piece), and a load copies each rank's slice of the global tensor straight
into its shard. Why this and not data-parallel rank 0 gathering one unit at a time and writing
it: the loader already assembles flat ranges for any tensor, so the format and resharding stay
as they are (any layout and strategy reads it); nothing is gathered, so a save or load holds no
whole parameters at all (training holds its shard plus about two units); the writing is spread
over all ranks, one file each; and there is no collective inside the write or the read, where a
rank that failed would leave the others waiting instead of agreeing on the error (``collectively``).
"""
from __future__ import annotations

import torch

from megatron_lite.checkpointing.metadata_schema import FORMAT_VERSION
from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.config import Config
from megatron_lite.model.weight_init import TIED_WEIGHT_NAME
from megatron_lite.process_groups import failures


OPTIMIZER_PREFIX = "optimizer."


def layout_of(config: Config, parallel_state) -> dict:
    layout = {"world_size": parallel_state.world_size,
              "tensor_model_parallel_size": parallel_state.tensor_model_parallel_world_size,
              "pipeline_model_parallel_size": parallel_state.pipeline_model_parallel_world_size,
              "data_parallel_size": parallel_state.data_parallel_world_size,
              "virtual_pipeline_model_parallel_size": config.parallel.virtual_pipeline_model_parallel_size,
              "use_distributed_optimizer": config.parallel.use_distributed_optimizer}
    if config.model.num_experts is not None:  # a dense model's layout reads as it always did
        layout.update(expert_model_parallel_size=parallel_state.expert_model_parallel_world_size,
                      expert_tensor_parallel_size=parallel_state.expert_tensor_parallel_world_size)
    return layout


def zero3_slices_of(model_chunks) -> dict:
    """ZeRO-3's sharded parameters -> the ``ParamSlice`` (a flat range of the parameter) this rank's
    shard holds, or None where all of it lies in other ranks' shards. Every other parameter (other
    strategies, bare models, a PEFT run's frozen base) is whole on this rank."""
    slices: dict = {}
    for chunk in model_chunks:
        if getattr(chunk, "fully_sharded", None) is not None:
            slices.update(dict.fromkeys(chunk.param_to_bucket))
            slices.update({s.param: s for s in chunk.param_slices()})
    return slices


def unwrap(model_chunks) -> list:
    """The GPTModels inside DistributedDataParallel wrappers (bare models pass through)."""
    return [getattr(chunk, "module", chunk) for chunk in model_chunks]


def checkpoint_name(model, name: str) -> str:
    """The name a parameter is stored under: the last stage's copy of the tied embedding is the embedding."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return TIED_WEIGHT_NAME
    return name


def is_stage_copy(model, name: str, param) -> bool:
    """Whether ``param`` is a later stage's copy of a weight the first stage holds (the tied output layer, the
    embedding multi-token prediction reads on the last stage): stored by the first stage alone, under its name."""
    return checkpoint_name(model, name) != name or (getattr(param, "shared_embedding", False)
                                                    and not model.pre_process)


def optimizer_key(state: str, name: str) -> str:
    return f"{OPTIMIZER_PREFIX}{state}.{name}"


def checkpointed_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint holds of ``model``: its parameters, and its persistent buffers (a router's expert
    bias: state that training moves, though not the optimizer)."""
    buffers = [(name, t) for name, t in model.state_dict(keep_vars=True).items()
               if not isinstance(t, torch.nn.Parameter)]
    return list(model.named_parameters()) + buffers


def is_trained(tensor, config: Config) -> bool:
    """Whether ``tensor`` is this run's to train and save: a parameter that requires grad; a buffer unless
    the run trains PEFT weights on a frozen base (the base's buffers are the base's)."""
    if isinstance(tensor, torch.nn.Parameter):
        return tensor.requires_grad
    return config.peft.peft is None


def new_metadata(config: Config, *, iteration: int, training_state: dict, layout: dict, scheduler: dict | None,
                 optimizer: dict | None = None) -> dict:
    """metadata.json before the ranks' files are entered (``tensors``, ``files``, ``rng``).

    ``optimizer`` holds the optimizer's non-tensor state (param groups, loss scaler); None
    marks a weights-only checkpoint.
    """
    return {"format": FORMAT_VERSION, "iteration": iteration, "training_state": training_state,
            "config": config.to_dict(), "layout": layout, "scheduler": scheduler, "optimizer": optimizer,
            "tensors": {}, "files": {}, "rng": {}}


def collectively(fn, what: str, path: str):
    """Run ``fn`` on every rank; if any rank fails, every rank raises (none is left waiting)."""
    return failures.run_on_every_rank(fn, f"{what} the checkpoint at {path}")


# Small non-tensor state (param groups, loss scaler) as JSON


def encode_state(value):
    if torch.is_tensor(value):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: encode_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_state(v) for v in value]
    return value


def decode_state(value):
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"unknown tensor dtype {value['dtype']!r} in the checkpoint metadata.")
        return torch.tensor(value["__tensor__"], dtype=dtype)
    if isinstance(value, dict):
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value
