"""Write a checkpoint for any (tensor, pipeline) layout from global tensors, in one process.

The converter (``tools/checkpoint_convert.py``) and the Hugging Face import use
this: they have whole tensors by name and want the files a run at
``--tensor-model-parallel-size T --pipeline-model-parallel-size P`` (data-parallel
size 1) would have written. Which parameters exist and how each is split is read
off the model itself, built on the meta device (no memory, no process group).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.resharding import (CheckpointReader, ShardedTensor, has_vocab_rows, index_of,
                                                    merge_index, resize_vocab)
from megatron_lite.checkpointing.contents import (OPTIMIZER_PREFIX, checkpointed_tensors, is_stage_copy, is_trained,
                                                  new_metadata)
from megatron_lite.config import Config
from megatron_lite.model import GPTModel
from megatron_lite.model.builder import build_model_chunk
from megatron_lite.process_groups.parallel_state import RankLayout, mock_parallel_state
from megatron_lite.tensor_parallel import shard_tensor


def stage_model(config: Config, pipeline_rank: int) -> GPTModel:
    """Pipeline stage ``pipeline_rank``'s model at tensor-parallel size 1, on the meta device:
    its parameter names, full shapes and split attributes. One chunk per stage: checkpoints
    name layers globally, so virtual stages do not change what is stored."""
    whole_stage = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None))
    with torch.device("meta"):
        return build_model_chunk(whole_stage, mock_parallel_state(0, 1), pipeline_rank=pipeline_rank)


def write_checkpoint(root: str, config: Config, read: Callable[[str], torch.Tensor], *, iteration: int,
                     optimizer_keys: tuple = (), training_state: Optional[dict] = None,
                     scheduler: Optional[dict] = None, optimizer: Optional[dict] = None) -> str:
    """Write ``root/iter_{iteration}`` for ``config.parallel``'s tensor and pipeline sizes.

    Args:
        root: the checkpoint root (gets ``latest_checkpointed_iteration.txt``).
        config: the run's configuration; its parallel sizes are the target layout.
        read: global tensor by stored name (model parameters; ``optimizer.<state>.<param>``).
        iteration: the iteration to record.
        optimizer_keys: stored optimizer-state names to carry over (empty: weights only).
        training_state, scheduler, optimizer: the saved run's non-tensor state (None: weights only).

    Returns:
        The checkpoint directory.
    """
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    if config.parallel.expert_model_parallel_size != 1 or config.parallel.expert_tensor_size != tp:
        raise ValueError("checkpoints are written offline with every expert on every rank, each split as a dense "
                         "MLP (expert-model-parallel size 1, expert-tensor size = tensor size); any expert "
                         "layout loads them.")
    layout = RankLayout(tp * pp, tp, pp)
    staging = storage.prepare_staging(root, iteration)
    metadata = new_metadata(
        config, iteration=iteration, training_state=training_state or {"iteration": iteration},
        layout={"world_size": tp * pp, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "data_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                "use_distributed_optimizer": False},
        scheduler=scheduler, optimizer=optimizer)
    states_of: dict = {}
    for key in optimizer_keys:
        name = key.removeprefix(OPTIMIZER_PREFIX).split(".", 1)[1]
        states_of.setdefault(name, []).append(key)

    for pipeline_rank in range(pp):
        model = stage_model(config, pipeline_rank)
        # As in training: the later stages' copies of the embedding are the first stage's, a PEFT base is its own
        # checkpoint, and a router's expert bias (a buffer) is saved with the weights.
        named = [(name, p) for name, p in checkpointed_tensors(model)
                 if not is_stage_copy(model, name, p) and is_trained(p, config)]
        layers = sorted(int(n) for n in model.decoder.layers.keys())
        # Each stage's global tensors are read once and cut for every tensor-parallel rank.
        full = {key: read(key) for name, _ in named for key in [name, *states_of.get(name, [])]}
        for tp_rank in range(tp):
            pieces = _rank_pieces(config, named, full, states_of, tp_rank=tp_rank)
            rank = layout.rank(tensor=tp_rank, data=0, pipeline=pipeline_rank)
            file_name = storage.rank_file_name(rank)
            info = storage.write_tensor_file(os.path.join(staging, file_name), {p.key: p.data for p in pieces})
            metadata["files"][file_name] = {**info, "rank": rank, "layers": layers,
                                            "tensor_model_parallel_rank": tp_rank,
                                            "pipeline_model_parallel_rank": pipeline_rank, "data_parallel_rank": 0}
            merge_index(metadata["tensors"], index_of(pieces, file_name))
    storage.write_json(os.path.join(staging, storage.METADATA_FILE), metadata)
    return storage.commit(root, iteration)


def _rank_pieces(config: Config, named: list, full: dict, states_of: dict, *, tp_rank: int) -> list[ShardedTensor]:
    """What tensor-parallel rank ``tp_rank`` of a stage writes: its shard of every parameter and of
    that parameter's optimizer states; replicated tensors and scalars only on rank 0."""
    tp = config.parallel.tensor_model_parallel_size
    padded_vocab = config.model.padded_vocab_size(tp)
    pieces = []
    for name, param in named:
        vocab_size = config.model.vocab_size if has_vocab_rows(name) else None
        for key in [name, *states_of.get(name, [])]:
            replicated = not getattr(param, "tensor_model_parallel", False) or full[key].dim() == 0
            if replicated and tp_rank != 0:
                continue
            pieces.append(_piece(key, full[key], param, tp_rank=tp_rank, tp_size=tp, padded_vocab=padded_vocab,
                                 vocab_size=vocab_size))
    return pieces


def _piece(key: str, full: torch.Tensor, param, *, tp_rank: int, tp_size: int, padded_vocab: int,
           vocab_size: Optional[int]) -> ShardedTensor:
    """This tensor-parallel rank's piece of ``full``, split like ``param`` (a tensor-parallel-size-1 parameter)."""
    if full.dim() == 0:  # a scalar optimizer state (Adam's step)
        return ShardedTensor(key, full, ())
    if vocab_size is not None:
        full = resize_vocab(full, padded_vocab)
    if not getattr(param, "tensor_model_parallel", False):
        return ShardedTensor(key, full, tuple(full.shape), vocab_size=vocab_size)
    local = shard_tensor(full, partition_dim=param.partition_dim, partition_stride=param.partition_stride,
                         rank=tp_rank, world_size=tp_size)
    return ShardedTensor(key, local, tuple(full.shape), param.partition_dim, param.partition_stride, tp_rank, tp_size,
                         vocab_size=vocab_size)


def reshard_checkpoint(load_dir: str, save_dir: str, *, tensor_model_parallel_size: int,
                       pipeline_model_parallel_size: int) -> str:
    """Rewrite a checkpoint for another (tensor, pipeline) layout, optimizer state included.

    Any layout loads any checkpoint anyway; this makes the files match the layout
    that will read them (one file per rank, nothing to gather at load time).
    """
    reader = CheckpointReader(storage.resolve_checkpoint_dir(load_dir))
    reader.verify(reader.tensors)
    metadata = reader.metadata
    config = Config.from_dict(metadata["config"])
    same_pipeline = pipeline_model_parallel_size == config.parallel.pipeline_model_parallel_size
    parallel = dataclasses.replace(
        config.parallel, tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size, expert_model_parallel_size=1,
        expert_tensor_parallel_size=None, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=config.parallel.decoder_first_pipeline_num_layers if same_pipeline else None,
        decoder_last_pipeline_num_layers=config.parallel.decoder_last_pipeline_num_layers if same_pipeline else None)
    config = dataclasses.replace(config, parallel=parallel)  # re-validates heads, groups, ffn against the new sizes
    return write_checkpoint(
        save_dir, config, reader.read, iteration=metadata["iteration"],
        optimizer_keys=tuple(k for k in reader.tensors if k.startswith(OPTIMIZER_PREFIX)),
        training_state=metadata["training_state"], scheduler=metadata["scheduler"], optimizer=metadata["optimizer"])
