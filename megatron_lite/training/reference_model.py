"""The frozen reference model of --dpo and --grpo, and the forward-only passes that score micro-batches with it.

The reference is a second copy of --pretrained-checkpoint at this rank's layout (its tensor- and
pipeline-parallel shard, whole across the data-parallel ranks: it keeps no gradients or optimizer state), or
under --peft lora the policy itself with its adapters off (the frozen base; no second copy).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from megatron_lite import checkpointing
from megatron_lite.config import CheckpointConfig, Config, PeftConfig
from megatron_lite.model.builder import build_model, current_device
from megatron_lite.peft.apply import adapters_disabled


def reference_config(config: Config) -> Config:
    """The reference model's configuration: the run's model without PEFT, loaded from --pretrained-checkpoint."""
    checkpoint = CheckpointConfig(pretrained_checkpoint=config.checkpoint.pretrained_checkpoint)
    return dataclasses.replace(config, peft=PeftConfig(), checkpoint=checkpoint)


def build_reference(config: Config, parallel_state) -> list:
    """A frozen copy of --pretrained-checkpoint at this rank's layout."""
    reference = reference_config(config)
    chunks = build_model(reference, parallel_state)
    checkpointing.load_checkpoint(reference, parallel_state, chunks, None, None)  # it loads trainable weights
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def to_device(batch: dict) -> dict:
    """A micro-batch's tensors on the model's device."""
    return {key: value.to(current_device(), non_blocking=True) for key, value in batch.items()}


@torch.no_grad()
def forward_only_outputs(run_schedule, config: Config, parallel_state, model_chunks: list, micro_batches: list,
                         num_microbatches: int, forward_step_func, key: str, *, adapters_off: bool = False) -> list:
    """What ``forward_step_func``'s loss dicts hold under ``key`` for each micro-batch (last stage), from one
    forward-only pass of the schedule in eval mode over ``micro_batches`` (a list of micro-batches per model
    chunk); ``adapters_off``: with every LoRA switched off (the base model)."""
    was_training = [chunk.training for chunk in model_chunks]
    for chunk in model_chunks:
        chunk.eval()
    iterators = [iter(batches) for batches in micro_batches]
    with adapters_disabled(model_chunks) if adapters_off else contextlib.nullcontext():
        losses = run_schedule(config, parallel_state, model_chunks, iterators if len(iterators) > 1 else iterators[0],
                              num_microbatches, forward_only=True, forward_step_func=forward_step_func)
    for chunk, training in zip(model_chunks, was_training):
        chunk.train(training)
    return [entry[key] for entry in losses]
