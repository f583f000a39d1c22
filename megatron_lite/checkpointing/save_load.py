"""Saving and loading during training, by every rank of any layout.

Save: each rank writes one safetensors file with what only it holds: its
tensor-parallel shard of its stage's weights (data-parallel rank 0 only; the other
replicas, context-parallel ranks included, hold the same values), its optimizer state
(rank 0 of the data x context group, or every rank's own slice under the distributed
optimizer) and its RNG states. Replicated tensors are written by tensor-parallel rank 0 only, and the tied
output layer of the last pipeline stage not at all (it is the word embedding).
Frozen weights are not written: a PEFT run's checkpoint holds its adapters and
points at the base they were trained on (``peft_base``).
Rank 0 then merges the ranks' indexes into ``metadata.json`` and commits the
directory (``storage.commit``). Every sharding strategy writes the same format:
optimizer state as each rank's flat ranges, weights whole or as flat ranges.

ZeRO-3 (optim_grads_params) keeps no whole weights: it is for models that do not fit whole
on one rank, so a save or load must not gather them. Each data-parallel rank writes the flat
slice of each weight its shard holds, exactly as the distributed optimizer writes its state
(a ``flat_range`` per piece), and a load copies each rank's slice of the global tensor straight
into its shard. Why this and not data-parallel rank 0 gathering one unit at a time and writing
it: the loader already assembles flat ranges for any tensor, so the format and resharding stay
as they are (any layout and strategy reads it); nothing is gathered, so a save or load holds no
whole parameters at all (training holds its shard plus about two units); the writing is spread
over all ranks, one file each; and there is no collective inside the write or the read, where a
rank that failed would leave the others waiting instead of agreeing on the error (below).

Load: each rank asks the checkpoint for the global tensors its parameters are cut
from, by name, and keeps its own shard (``resharding``), so the saving and the
loading layouts are independent, and so are the strategies. RNG states are restored only
under the same layout; the data position is the global ``consumed_train_samples``, which every
data-parallel size reads the same way.

Every rank checks the files it reads; ranks agree on success (one all-reduce)
before training continues, so a bad file is a clear error on every rank rather
than one rank failing while the others wait in a collective.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import sys
import warnings

import torch

from megatron_lite.process_groups import failures
from megatron_lite.checkpointing import peft_base, rng, storage
from megatron_lite.checkpointing.architecture import check_architecture
from megatron_lite.checkpointing.metadata_schema import FORMAT_VERSION
from megatron_lite.checkpointing.resharding import (CheckpointReader, ShardedTensor, has_vocab_rows, index_of,
                                                    local_shard, merge_index)
from megatron_lite.checkpointing.storage import CheckpointError, read_metadata, resolve_checkpoint_dir
from megatron_lite.config import CheckpointConfig, Config
from megatron_lite.model.weight_init import TIED_WEIGHT_NAME
from megatron_lite.tensor_parallel.random import set_random_seeds
from megatron_lite.checkpointing.training_state import TrainingState

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


def _zero3_slices(model_chunks) -> dict:
    """ZeRO-3's sharded parameters -> the ``ParamSlice`` (a flat range of the parameter) this rank's
    shard holds, or None where all of it lies in other ranks' shards. Every other parameter (other
    strategies, bare models, a PEFT run's frozen base) is whole on this rank."""
    slices: dict = {}
    for chunk in model_chunks:
        if getattr(chunk, "fully_sharded", None) is not None:
            slices.update(dict.fromkeys(chunk.param_to_bucket))
            slices.update({s.param: s for s in chunk.param_slices()})
    return slices


def _unwrap(model_chunks) -> list:
    """The GPTModels inside DistributedDataParallel wrappers (bare models pass through)."""
    return [getattr(chunk, "module", chunk) for chunk in model_chunks]


def read_config(load_dir: str) -> Config:
    """The configuration a checkpoint (root or ``iter_*`` directory) was saved with."""
    return Config.from_dict(read_metadata(resolve_checkpoint_dir(load_dir))["config"])


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


def _stored_by_this_rank(model, name: str, param, parallel_state, config: Config) -> bool:
    """Trained tensors only (a frozen base is the base checkpoint's). The tied output copy is
    stored once, as the embedding; a tensor replicated over the ranks that split it (tensor-parallel,
    expert-tensor-parallel for expert weights) is stored once, by their rank 0."""
    if is_stage_copy(model, name, param) or not is_trained(param, config):
        return False
    return getattr(param, "tensor_model_parallel", False) or parallel_state.tensor_split(param)[0] == 0


# ---------------------------------------------------------------------------------------------
# Save


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
    _collectively(_writing(lambda: storage.prepare_staging(root, iteration) if rank == 0 else None, root),
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
    """Every rank raises together (``_collectively``); the half-written staging directory would hold the
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
        _collectively(_writing(write, snapshot.root), "write", snapshot.root)


def commit_snapshot(snapshot: Snapshot) -> None:
    """Every rank, once every rank's ``write_snapshot`` succeeded: rank 0 merges the indexes into
    metadata.json, checks every file is there at its size, and commits."""
    with removing_staging_on_failure(snapshot):
        _collectively(_writing(lambda: _commit(snapshot) if snapshot.rank == 0 else None, snapshot.root),
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
    models = _unwrap(model_chunks)
    pieces = _model_pieces(config, parallel_state, models, _zero3_slices(model_chunks))
    # Without the distributed optimizer the replicas' states are identical: each parameter's first replica
    # saves it (data-parallel rank 0; expert-data-parallel rank 0 for experts).
    writes_optimizer = (config.parallel.use_distributed_optimizer or parallel_state.data_parallel_rank == 0
                        or parallel_state.expert_data_parallel_rank == 0)
    optimizer_state = optimizer.state_dict() if optimizer is not None and writes_optimizer else None
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
        index["optimizer"] = _encode({k: optimizer_state[k] for k in
                                      ("param_groups", "grad_scaler", "num_skipped_iterations")})
    return tensors, index


def _commit(snapshot: Snapshot) -> None:
    """Rank 0, once every rank's file is written: merge the indexes into metadata.json and commit."""
    metadata = copy.deepcopy(snapshot.metadata)
    _merge_rank_indexes(snapshot.staging, snapshot.world_size, metadata)
    storage.verify_files(snapshot.staging, metadata)  # every rank's file there, at its recorded size
    storage.write_json(os.path.join(snapshot.staging, storage.METADATA_FILE), metadata)
    storage.commit(snapshot.root, snapshot.iteration)


def new_metadata(config: Config, *, iteration: int, training_state: dict, layout: dict, scheduler: dict | None,
                 optimizer: dict | None = None) -> dict:
    """metadata.json before the ranks' files are entered (``tensors``, ``files``, ``rng``).

    ``optimizer`` holds the optimizer's non-tensor state (param groups, loss scaler); None
    marks a weights-only checkpoint.
    """
    return {"format": FORMAT_VERSION, "iteration": iteration, "training_state": training_state,
            "config": config.to_dict(), "layout": layout, "scheduler": scheduler, "optimizer": optimizer,
            "tensors": {}, "files": {}, "rng": {}}


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


# ---------------------------------------------------------------------------------------------
# Load


def load_checkpoint(config: Config, parallel_state, model_chunks, optimizer, scheduler):
    """Load the newest checkpoint of ``--load`` (or ``--pretrained-checkpoint``) into this rank's
    chunks, optimizer and scheduler.

    ``model_chunks`` may be DistributedDataParallel-wrapped or bare GPTModels;
    ``optimizer`` and ``scheduler`` may be None (inference, export).

    Returns the saved TrainingState (iteration 0 with --finetune), or None when
    there is no checkpoint to load (``checkpoint_to_load``). ``--no-load-optim`` skips
    the optimizer state (main parameters restart from the loaded weights),
    ``--no-load-rng`` the RNG states; ``--finetune`` loads the weights only and starts
    at iteration 0. A weights-only checkpoint (converted or imported) loads like
    ``--finetune``, and so does ``--pretrained-checkpoint``. Under --peft a full checkpoint
    is the frozen base (weights only), and an adapter checkpoint brings its base along
    (``peft_base``).
    """
    checkpoint = config.checkpoint
    source = _collectively(lambda: checkpoint_to_load(checkpoint), "open",
                           checkpoint.load or checkpoint.pretrained_checkpoint)
    return load_checkpoint_from(source, config, parallel_state, model_chunks, optimizer, scheduler)


def load_checkpoint_from(source: tuple[str, int, bool] | None, config: Config, parallel_state, model_chunks,
                         optimizer, scheduler):
    """``load_checkpoint`` of the checkpoint ``checkpoint_to_load`` found (its ``source``, the same on every
    rank): the trainer finds it once at start-up (``training.run_plan``)."""
    checkpoint = config.checkpoint
    if source is None:
        if parallel_state.rank == 0:  # Megatron's resume-or-start, which launch scripts rely on: say it loudly
            print(f" WARNING: no checkpoint in --load {checkpoint.load} ({storage.TRACKER_FILE} is missing): "
                  "TRAINING STARTS FROM RANDOM WEIGHTS. If you meant to resume or fine-tune, check the path "
                  "(--finetune makes a missing checkpoint an error).", file=sys.stderr, flush=True)
        return None
    root, iteration, finetune = source
    directory = storage.checkpoint_dir(root, iteration)
    result = _collectively(lambda: _load_local(config, parallel_state, model_chunks, optimizer, scheduler,
                                               directory, finetune), "load", directory)
    if result["reseed"]:
        _reseed(config, parallel_state, iteration)
    if parallel_state.rank == 0:
        print(f" loaded checkpoint {directory} (saved at iteration {iteration}, layout {result['saved_layout']})"
              + _base_note(result["training_state"]["peft_base"], directory), flush=True)
    return TrainingState(**result["training_state"])


def _base_note(base: dict | None, directory: str) -> str:
    if base is None:
        return ""
    if "init_seed" in base:
        return f"; frozen base: initialised with --seed {base['init_seed']}"
    if base["directory"] == os.path.abspath(directory):
        return "; it is the frozen base of the PEFT weights, which start from their initial values"
    return f"; frozen base: {base['directory']} (checksum verified)"


def checkpoint_to_load(checkpoint: CheckpointConfig) -> tuple[str, int, bool] | None:
    """(root, iteration, finetune) of the checkpoint a run starts from, or None for a fresh start.

    As Megatron-LM: ``--load`` wins when it holds a checkpoint, so a fine-tuning job
    restarted with the same flags resumes from its own saves; otherwise
    ``--pretrained-checkpoint`` is loaded like ``--finetune``. Fine-tuning from nothing is an
    error: ``--pretrained-checkpoint``, or ``--finetune`` with ``--load``, must hold a checkpoint.
    """
    if checkpoint.load:
        iteration = storage.read_latest_iteration(checkpoint.load)
        if iteration is not None:
            return checkpoint.load, iteration, checkpoint.finetune
    if checkpoint.pretrained_checkpoint:
        storage.check_is_directory(checkpoint.pretrained_checkpoint, "--pretrained-checkpoint")
        iteration = storage.read_latest_iteration(checkpoint.pretrained_checkpoint)
        if iteration is None:
            raise CheckpointError(f"--pretrained-checkpoint {checkpoint.pretrained_checkpoint} holds no checkpoint "
                                  f"({storage.TRACKER_FILE} is missing): point it at a training run's --save "
                                  f"directory or at tools/checkpoint_convert.py's --save-dir.")
        return checkpoint.pretrained_checkpoint, iteration, True
    if checkpoint.load and checkpoint.finetune:
        storage.check_is_directory(checkpoint.load, "--finetune needs a checkpoint, but --load")
        raise CheckpointError(f"--finetune needs a checkpoint, but --load {checkpoint.load} holds none "
                              f"({storage.TRACKER_FILE} is missing); point --load at the pretrained checkpoint.")
    return None


def _load_local(config, parallel_state, model_chunks, optimizer, scheduler, directory, finetune: bool) -> dict:
    """Everything a rank does to load, without communication (so failures can be agreed on first)."""
    reader = CheckpointReader(directory)
    metadata = reader.metadata
    check_architecture(metadata["config"]["model"], config.model, directory)
    # The Hugging Face family the model was imported as: this run's checkpoints record it again, so that their
    # export writes it (--hf-model-type chose another if given). Every rank reads the same metadata.
    if config.model.hf_model_type is None:
        config.model.hf_model_type = metadata["config"]["model"].get("hf_model_type")
    frozen_source, trainable_source, base = peft_base.weight_sources(config, reader)
    if frozen_source not in (None, reader):
        check_architecture(frozen_source.metadata["config"]["model"], config.model, frozen_source.directory)
    weights_only, load_optimizer, load_rng = _what_to_load(config, parallel_state, metadata, optimizer,
                                                           finetune or trainable_source is None)

    params = [(model, name, p) for model in _unwrap(model_chunks) for name, p in checkpointed_tensors(model)]
    trainable = [(model, name, p) for model, name, p in params if isinstance(p, torch.nn.Parameter) and p.requires_grad]
    sources = {source: [(model, name, p) for model, name, p in params if is_trained(p, config) == is_trainable]
               for source, is_trainable in ((frozen_source, False), (trainable_source, True)) if source is not None}
    optimizer_states = _optimizer_states(reader) if load_optimizer else {}
    for source, loaded in sources.items():
        needed = [checkpoint_name(model, name) for model, name, _ in loaded]
        if source is reader:
            needed += [stored for key in needed for stored in optimizer_states.get(key, {}).values()]
        own_file = [storage.rank_file_name(parallel_state.rank)] if load_rng and source is reader else []
        source.verify(needed, extra_files=own_file)

    zero3_slices = _zero3_slices(model_chunks)
    for source, loaded in sources.items():
        for model, name, param in loaded:
            _load_weight(source, checkpoint_name(model, name), param, zero3_slices, *parallel_state.tensor_split(param))
    if load_optimizer:
        optimizer.load_state_dict(_optimizer_state_dict(reader, optimizer_states, trainable, zero3_slices,
                                                        parallel_state))
    elif optimizer is not None:
        optimizer.reload_model_params()  # its fp32 main parameters were copied before the weights were loaded
    if scheduler is not None and not weights_only and metadata["scheduler"] is not None:
        scheduler.load_state_dict(metadata["scheduler"], override=config.optimizer.override_opt_param_scheduler,
                                  use_checkpoint=config.optimizer.use_checkpoint_opt_param_scheduler)
    if load_rng:
        own_file = storage.rank_file_name(parallel_state.rank)
        tensors = {name: reader.read_stored(own_file, name) for name in reader.stored_names(own_file)
                   if name.startswith(rng.PREFIX)}
        rng.set_rng_state(tensors, metadata["rng"][str(parallel_state.rank)])
    training_state = {"iteration": 0} if weights_only else dict(metadata["training_state"])
    training_state["peft_base"] = base
    if not parallel_state.is_pipeline_last_stage():
        training_state["losses"] = []  # losses live on the last stage, as in training
    return {"training_state": training_state, "reseed": not load_rng and not weights_only,
            "saved_layout": metadata["layout"]}


@torch.no_grad()
def _load_weight(source: CheckpointReader, key: str, param, zero3_slices: dict, tp_rank: int, tp_size: int) -> None:
    """Load the global tensor ``key`` into what this rank holds of ``param``: its tensor-parallel shard,
    or under ZeRO-3 the flat slice of that shard in this rank's shard of the bucket (nothing is gathered)."""
    if param not in zero3_slices:
        param.data.copy_(local_shard(key, source.entry(key), source.read(key), param, tp_rank=tp_rank,
                                     tp_size=tp_size))
    elif (held := zero3_slices[param]) is not None:
        value = local_shard(key, source.entry(key), source.read(key), param, tp_rank=tp_rank, tp_size=tp_size,
                            local_shape=held.shape)
        held.data.copy_(value.reshape(-1)[held.start:held.end])


def _what_to_load(config, parallel_state, metadata: dict, optimizer, finetune: bool) -> tuple[bool, bool, bool]:
    """(weights_only, load_optimizer, load_rng) from the flags and what the checkpoint holds."""
    weights_only = finetune or metadata["optimizer"] is None
    load_optimizer = optimizer is not None and not weights_only and not config.checkpoint.no_load_optim
    # RNG states belong to ranks: they mean something only under the layout that saved them.
    has_rng = metadata["layout"] == layout_of(config, parallel_state) and bool(metadata["rng"])
    wants_rng = not weights_only and not config.checkpoint.no_load_rng
    if wants_rng and not has_rng and parallel_state.rank == 0:
        warnings.warn(f"the checkpoint was saved with layout {metadata['layout']} (random-number states: "
                      f"{'yes' if metadata['rng'] else 'none'}), this run has {layout_of(config, parallel_state)}: "
                      f"random-number states are reseeded from --seed and the iteration, so dropout masks differ "
                      f"from an uninterrupted run.")
    return weights_only, load_optimizer, has_rng and wants_rng


def _optimizer_states(reader: CheckpointReader) -> dict:
    """{parameter key: {state name: stored key}} for the optimizer tensors in the checkpoint."""
    states: dict = {}
    for stored in reader.tensors:
        if stored.startswith(OPTIMIZER_PREFIX):
            state, key = stored.removeprefix(OPTIMIZER_PREFIX).split(".", 1)
            states.setdefault(key, {})[state] = stored
    return states


def _optimizer_state_dict(reader: CheckpointReader, optimizer_states: dict, params: list, zero3_slices: dict,
                          parallel_state) -> dict:
    """The optimizer's own state-dict format, each entry covering what this rank holds of the parameter
    (the optimizer slices out its range): the whole tensor-parallel shard, or ZeRO-3's flat slice of it.
    fp32 models store no main parameters: they are the weights, loaded already."""
    entries = {}
    for model, name, param in params:
        held = zero3_slices.get(param)
        if param in zero3_slices and held is None:
            continue  # no range of it on this rank
        shape = param.shape if held is None else held.shape
        start, end = (0, param.numel()) if held is None else (held.start, held.end)
        stored = optimizer_states.get(checkpoint_name(model, name), {})
        tp_rank, tp_size = parallel_state.tensor_split(param)

        def shard(key):
            full = reader.read(key)
            if full.dim() == 0:
                return full
            value = local_shard(key, reader.entry(key), full, param, tp_rank=tp_rank, tp_size=tp_size,
                                local_shape=shape)
            return value.reshape(-1)[start:end]

        weights = param.detach().reshape(-1) if held is None else held.data
        main = shard(stored["main_param"]) if "main_param" in stored else weights.float()
        entries[name] = {"shape": tuple(shape), "range": (start, end), "main_param": main,
                         "state": {state: shard(key) for state, key in stored.items() if state != "main_param"}}
    return {"params": entries, **_decode(reader.metadata["optimizer"])}


def _reseed(config, parallel_state, iteration: int) -> None:
    # Seeding with the iteration keeps a resumed run from replaying the first iterations' dropout masks.
    set_random_seeds(config.training.seed + iteration, parallel_state)


# ---------------------------------------------------------------------------------------------
# Agreement across ranks


def _collectively(fn, what: str, path: str):
    """Run ``fn`` on every rank; if any rank fails, every rank raises (none is left waiting)."""
    return failures.run_on_every_rank(fn, f"{what} the checkpoint at {path}")


# ---------------------------------------------------------------------------------------------
# Small non-tensor state (param groups, loss scaler) as JSON


def _encode(value):
    if torch.is_tensor(value):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"unknown tensor dtype {value['dtype']!r} in the checkpoint metadata.")
        return torch.tensor(value["__tensor__"], dtype=dtype)
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
