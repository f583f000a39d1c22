"""Distributed checkpoints that reshard, resume exactly and load safely.

    save_checkpoint(config, parallel_state, model_chunks, optimizer, scheduler, state)
    load_checkpoint(config, parallel_state, model_chunks, optimizer, scheduler) -> TrainingState | None
    load_checkpoint_from(source, config, ...)   (the same, when the caller has found the checkpoint already)
    read_config(load_dir) -> Config      (the configuration a checkpoint was saved with)

``storage`` is the on-disk format (safetensors + JSON, atomic commit, checksums),
``resharding`` maps global tensors to and from any layout's shards, ``rng`` the
random states, ``saving`` and ``loading`` what the training loop calls (``contents``: what a checkpoint
holds, under which names), ``offline`` writes
checkpoints from global tensors (``tools/checkpoint_convert.py`` and ``megatron_lite.interop``, which
converts Hugging Face and Megatron-LM checkpoints to ours and back); ``training_state`` is the
loop's progress that a checkpoint restores.
"""
from megatron_lite.checkpointing.loading import load_checkpoint, load_checkpoint_from, read_config
from megatron_lite.checkpointing.saving import save_checkpoint
from megatron_lite.checkpointing.storage import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "load_checkpoint_from", "read_config", "CheckpointError"]
