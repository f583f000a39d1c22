"""Loading into every rank of any layout, from a checkpoint saved under any other.

Each rank asks the checkpoint for the global tensors its parameters are cut
from, by name, and keeps its own shard (``resharding``), so the saving and the
loading layouts are independent, and so are the strategies. RNG states are restored only
under the same layout; the data position is the global ``consumed_train_samples``, which every
data-parallel size reads the same way.

Every rank checks the files it reads; ranks agree on success (one all-reduce)
before training continues, so a bad file is a clear error on every rank rather
than one rank failing while the others wait in a collective.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

from megatron_lite.checkpointing import peft_base, rng, storage
from megatron_lite.checkpointing.architecture import check_architecture
from megatron_lite.checkpointing.contents import (OPTIMIZER_PREFIX, checkpoint_name, checkpointed_tensors,
                                                  collectively, decode_state, is_trained, layout_of, unwrap,
                                                  zero3_slices_of)
from megatron_lite.checkpointing.resharding import CheckpointReader, local_shard
from megatron_lite.checkpointing.storage import CheckpointError, read_metadata, resolve_checkpoint_dir
from megatron_lite.checkpointing.training_state import TrainingState
from megatron_lite.config import CheckpointConfig, Config
from megatron_lite.tensor_parallel.random import set_random_seeds


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
    source = collectively(lambda: checkpoint_to_load(checkpoint), "open",
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
    result = collectively(lambda: _load_local(config, parallel_state, model_chunks, optimizer, scheduler,
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

    params = [(model, name, p) for model in unwrap(model_chunks) for name, p in checkpointed_tensors(model)]
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

    zero3_slices = zero3_slices_of(model_chunks)
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
    return {"params": entries, **decode_state(reader.metadata["optimizer"])}


def _reseed(config, parallel_state, iteration: int) -> None:
    # Seeding with the iteration keeps a resumed run from replaying the first iterations' dropout masks.
    set_random_seeds(config.training.seed + iteration, parallel_state)


def read_config(load_dir: str) -> Config:
    """The configuration a checkpoint (root or ``iter_*`` directory) was saved with."""
    return Config.from_dict(read_metadata(resolve_checkpoint_dir(load_dir))["config"])
