"""Saving during training, by every rank of any layout: take a snapshot, write it, commit it.

Each rank writes one safetensors file with what only it holds: its
tensor-parallel shard of its stage's weights (data-parallel rank 0 only; the other
replicas, context-parallel ranks included, hold the same values), its optimizer state
(rank 0 of the data x context group, or every rank's own slice under the distributed
optimizer) and its RNG states. Replicated tensors are written by tensor-parallel rank 0 only, and the tied
output layer of the last pipeline stage not at all (it is the word embedding).
Frozen weights are not written: a PEFT run's checkpoint holds its adapters and
points at the base they were trained on (``peft_base``).
Rank 0 then merges the ranks' indexes into ``metadata.json`` and commits the
directory (``storage.commit``). ZeRO-3's weights are written as flat slices (``contents``).

The three steps are separate functions so that ``async_save`` can run the write in the background:
``take_snapshot`` copies this rank's part off the live tensors, ``write_snapshot`` puts it on disk,
``commit_snapshot`` makes the checkpoint the latest once every rank wrote. Every step is collective
(``contents.collectively``): a rank that fails makes every rank raise, and the staging directory goes.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil

import torch

from megatron_lite.checkpointing import peft_base, rng, storage
from megatron_lite.checkpointing.contents import (checkpointed_tensors, collectively, encode_state, is_stage_copy,
                                                  is_trained, layout_of, new_metadata, optimizer_key, unwrap,
                                                  zero3_slices_of)
from megatron_lite.checkpointing.resharding import ShardedTensor, has_vocab_rows, index_of, merge_index
from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.config import Config


def save_checkpoint(config: Config, parallel_state, model_chunks, optimizer, scheduler, state) -> None:
    """Write ``SAVE/iter_{iteration:07d}/`` and point ``latest_checkpointed_iteration.txt`` at it (every rank)."""
    snapshot = take_snapshot(config, parallel_state, model_chunks, optimizer, scheduler, state)
    agree_on_writing(snapshot, lambda: write_snapshot(snapshot))
    commit_snapshot(snapshot)


@dataclasses.dataclass
class Snapshot:
    """One rank's part of a checkpoint, copied off the live tensors: what ``write_snapshot`` puts on disk,
    while training goes on and changes the model (``async_save``)."""

    root: str
    iteration: int
    rank: int
    world_size: int
    file_name: str
    tensors: dict  # name -> a CPU copy
    index: dict  # this rank's tensor index, RNG scalars and training state, merged into metadata.json at commit
    metadata: dict | None  # rank 0: metadata.json without the ranks' entries (the scheduler as of the save)

    @property
    def staging(self) -> str:
        return storage.staging_dir(self.root, self.iteration)


def take_snapshot(config: Config, parallel_state, model_chunks, optimizer, scheduler, state) -> Snapshot:
    """Create the staging directory (rank 0; every rank agrees) and copy this rank's part of the checkpoint
    to CPU memory. Every rank calls it at the same iteration."""
    root, iteration, rank = config.checkpoint.save, state.iteration, parallel_state.rank
    for chunk in model_chunks:  # weights must be final: finish any overlapped all-gather first
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    collectively(_writing(lambda: storage.prepare_staging(root, iteration) if rank == 0 else None, root),
                  "prepare", root)
    tensors, index = _rank_contents(config, parallel_state, model_chunks, optimizer, state)
    metadata = None
    if rank == 0:
        metadata = new_metadata(config, iteration=iteration, training_state={},
                                layout=layout_of(config, parallel_state),
                                scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None)
    return Snapshot(root=root, iteration=iteration, rank=rank, world_size=parallel_state.world_size,
                    file_name=index["file"], tensors=tensors, index=copy.deepcopy(index), metadata=metadata)


@contextlib.contextmanager
def removing_staging_on_failure(snapshot: Snapshot):
    """Every rank raises together (``collectively``); the half-written staging directory would hold the
    space a disk-full restart needs, so it goes (best effort: the error being raised is what matters)."""
    try:
        yield
    except Exception:
        if snapshot.rank == 0:
            shutil.rmtree(snapshot.staging, ignore_errors=True)
        raise


def write_snapshot(snapshot: Snapshot) -> None:
    """This rank's tensors (safetensors), read back and checked against the checksum they were written
    with (a file the disk did not keep is caught before it is committed), then their index (JSON)."""
    path = os.path.join(snapshot.staging, snapshot.file_name)
    info = storage.write_tensor_file(path, snapshot.tensors)
    if storage.sha256_file(path) != info["sha256"]:
        raise CheckpointError(f"{path} does not read back as it was written (its SHA-256 differs): the disk "
                              f"or file system under --save is faulty.")
    index = {**snapshot.index, "info": {**info, **snapshot.index["info"]}}
    storage.write_json(os.path.join(snapshot.staging, storage.rank_index_name(snapshot.rank)), index)


def agree_on_writing(snapshot: Snapshot, write) -> None:
    """Every rank: run ``write`` (``write_snapshot``, or the background writer's outcome); when it failed on
    any rank, every rank raises and the staging directory goes."""
    with removing_staging_on_failure(snapshot):
        collectively(_writing(write, snapshot.root), "write", snapshot.root)


def commit_snapshot(snapshot: Snapshot) -> None:
    """Every rank, once every rank's ``write_snapshot`` succeeded: rank 0 merges the indexes into
    metadata.json, checks every file is there at its size, and commits."""
    with removing_staging_on_failure(snapshot):
        collectively(_writing(lambda: _commit(snapshot) if snapshot.rank == 0 else None, snapshot.root),
                      "commit", snapshot.root)
    if snapshot.rank == 0:
        print(f" saved checkpoint at iteration {snapshot.iteration:7d} to {snapshot.root}", flush=True)


def _writing(fn, root: str):
    """``fn`` with a failed write (disk full, permissions) turned into an error the user can act on."""
    def run():
        try:
            return fn()
        except OSError as error:
            raise CheckpointError(
                f"could not write the checkpoint to --save {root}: {error.strerror or error} "
                f"({error.filename or root}). The previous checkpoint is untouched; free space or fix the "
                f"directory, then resume with --load {root}.") from None
    return run


def _rank_contents(config: Config, parallel_state, model_chunks: list, optimizer, state) -> tuple[dict, dict]:
    """This rank's tensors (CPU copies, by stored name) and their index, without its file's size and checksum."""
    rank = parallel_state.rank
    models = unwrap(model_chunks)
    pieces = _model_pieces(config, parallel_state, models, zero3_slices_of(model_chunks))
    # Without the distributed optimizer the replicas' states are identical: each parameter's first replica
    # saves it (data-parallel rank 0; expert-data-parallel rank 0 for experts).
    writes_optimizer = (config.parallel.use_distributed_optimizer or parallel_state.data_parallel_rank == 0
                        or parallel_state.expert_data_parallel_rank == 0)
    # The live state: the copy to host memory below is the snapshot's only one.
    optimizer_state = optimizer.state_dict(copy=False) if optimizer is not None and writes_optimizer else None
    if optimizer_state is not None:
        pieces += _optimizer_pieces(config, parallel_state, models, optimizer_state)
    rng_tensors, rng_scalars = rng.get_rng_state()
    file_name = storage.rank_file_name(rank)
    # Cloned: the live tensors change as training goes on, and safetensors refuses tensors sharing memory
    # (views of one flat parameter buffer).
    tensors = {name: t.detach().to("cpu", copy=True).contiguous()
               for name, t in {**{p.key: p.data for p in pieces}, **rng_tensors}.items()}
    # Who wrote the file and which layers (pipeline range) it holds, for readers of the metadata.
    holder = {"rank": rank, "layers": sorted(int(n) for m in models for n in m.decoder.layers),
              "tensor_model_parallel_rank": parallel_state.tensor_model_parallel_rank,
              "pipeline_model_parallel_rank": parallel_state.pipeline_model_parallel_rank,
              "data_parallel_rank": parallel_state.data_parallel_rank}
    training_state = dataclasses.asdict(state)
    if config.peft.peft is not None and state.peft_base is None:  # no base checkpoint was loaded
        training_state["peft_base"] = peft_base.pointer_to_initialisation(config)
    index = {"file": file_name, "info": holder, "tensors": index_of(pieces, file_name),
             "rng": rng_scalars, "training_state": training_state}
    if rank == 0 and optimizer_state is not None:  # rank 0 is the first replica of every parameter it holds
        index["optimizer"] = encode_state({k: optimizer_state[k] for k in
                                      ("param_groups", "grad_scaler", "num_skipped_iterations")})
    return tensors, index


def _commit(snapshot: Snapshot) -> None:
    """Rank 0, once every rank's file is written: merge the indexes into metadata.json and commit."""
    metadata = copy.deepcopy(snapshot.metadata)
    _merge_rank_indexes(snapshot.staging, snapshot.world_size, metadata)
    storage.verify_files(snapshot.staging, metadata)  # every rank's file there, at its recorded size
    storage.write_json(os.path.join(snapshot.staging, storage.METADATA_FILE), metadata)
    storage.commit(snapshot.root, snapshot.iteration)


def _model_pieces(config, parallel_state, models, zero3_slices: dict) -> list[ShardedTensor]:
    """The weights this rank writes: whole ones by the first of their replicas (data-parallel rank 0;
    expert-data-parallel rank 0 for expert weights), ZeRO-3's by every replica, each the flat slice its
    shard holds."""
    pieces = []
    for model in models:
        for name, param in checkpointed_tensors(model):
            if not _stored_by_this_rank(model, name, param, parallel_state, config):
                continue
            tp_rank, tp_size = parallel_state.tensor_split(param)
            vocab_size = config.model.vocab_size if has_vocab_rows(name) else None
            if param not in zero3_slices:
                if parallel_state.replica_rank(param) == 0:
                    pieces.append(ShardedTensor.of_parameter(name, param.detach(), param, tp_rank=tp_rank,
                                                             tp_size=tp_size, vocab_size=vocab_size))
            elif (held := zero3_slices[param]) is not None:
                pieces.append(ShardedTensor.of_parameter(
                    name, held.data, param, tp_rank=tp_rank, tp_size=tp_size, vocab_size=vocab_size,
                    flat_range=(held.start, held.end), local_shape=held.shape))
    return pieces


def _optimizer_pieces(config, parallel_state, models, optimizer_state: dict) -> list[ShardedTensor]:
    """Each parameter's optimizer state as flat slices of its tensor-parallel shard.

    The whole shard without the distributed optimizer, written by the first replica (whose states are
    identical), this rank's slice with it (the ``range`` the optimizer reports). fp32 main parameters are
    not written for fp32 models: they are the model weights themselves.
    """
    params = {name: (model, p) for model in models for name, p in model.named_parameters()}
    pieces = []
    for name, entry in optimizer_state["params"].items():
        model, param = params[name]
        if not _stored_by_this_rank(model, name, param, parallel_state, config):
            continue
        if not optimizer_state["data_parallel"]["sharded"] and parallel_state.replica_rank(param) != 0:
            continue
        tp_rank, tp_size = parallel_state.tensor_split(param)
        start, end = entry["range"]
        tensors = {k: v for k, v in entry["state"].items() if v.dim() == 1}
        if param.dtype != torch.float32:
            tensors["main_param"] = entry["main_param"]
        vocab_size = config.model.vocab_size if has_vocab_rows(name) else None
        for state_name, value in tensors.items():
            pieces.append(ShardedTensor.of_parameter(optimizer_key(state_name, name), value, param, tp_rank=tp_rank,
                                                     tp_size=tp_size, vocab_size=vocab_size, flat_range=(start, end),
                                                     local_shape=entry["shape"]))
        if start == 0:  # scalars (Adam's step) are the same in every slice: stored by the first
            pieces += [ShardedTensor(optimizer_key(k, name), v, ()) for k, v in entry["state"].items()
                       if v.dim() == 0]
    return pieces


def _merge_rank_indexes(staging: str, world_size: int, metadata: dict) -> None:
    for rank in range(world_size):
        path = os.path.join(staging, storage.rank_index_name(rank))
        with open(path) as f:
            index = json.load(f)
        os.remove(path)
        metadata["files"][index["file"]] = index["info"]
        metadata["rng"][str(rank)] = index["rng"]
        if rank == world_size - 1:  # the last rank is on the last pipeline stage, which has the losses
            metadata["training_state"] = index["training_state"]
        if "optimizer" in index:
            metadata["optimizer"] = index["optimizer"]
        merge_index(metadata["tensors"], index["tensors"])


def _stored_by_this_rank(model, name: str, param, parallel_state, config: Config) -> bool:
    """Trained tensors only (a frozen base is the base checkpoint's). The tied output copy is
    stored once, as the embedding; a tensor replicated over the ranks that split it (tensor-parallel,
    expert-tensor-parallel for expert weights) is stored once, by their rank 0."""
    if is_stage_copy(model, name, param) or not is_trained(param, config):
        return False
    return getattr(param, "tensor_model_parallel", False) or parallel_state.tensor_split(param)[0] == 0
