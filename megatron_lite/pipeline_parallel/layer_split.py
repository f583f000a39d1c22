"""Which transformer layers each pipeline stage (and each of its virtual chunks) holds.

Layers are numbered globally, 0 .. num_layers - 1, and keep their number on
whichever stage holds them (state-dict names do not depend on the layout).

Without interleaving, stage r holds one contiguous slice. With v chunks per
rank the model is cut into p * v slices and chunk c of rank r holds slice
``c * p + r``: the activations go round the ring of ranks v times. With
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
the first and last stages hold a given number of layers (they also carry the
embedding and the output layer + loss, so fewer layers balance them) and the
other stages share the rest evenly; every stage's layers are then spread evenly
over its v chunks.
"""
from __future__ import annotations

from typing import Optional

from megatron_lite.config import ConfigError


def _layers_per_stage(num_layers: int, p: int, first: Optional[int], last: Optional[int]) -> list[int]:
    """Layers held by each pipeline stage, over all its chunks."""
    if p == 1 and (first is not None or last is not None):
        raise ConfigError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
                          "--pipeline-model-parallel-size > 1.")
    for flag, value in [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]:
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}.")
    ends = [n for n in (first, last) if n is not None]
    middle_stages, middle_layers = p - len(ends), num_layers - sum(ends)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ConfigError(
            f"--num-layers ({num_layers}) does not match the first/last stage layers {ends} with "
            f"--pipeline-model-parallel-size {p}: the other {middle_stages} stage(s) would get {middle_layers} "
            f"layers. Change --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
    if middle_stages and middle_layers % middle_stages != 0:
        uneven = " after the first/last stage layers" if ends else ""
        raise ConfigError(
            f"--num-layers ({num_layers}) cannot be split evenly over the pipeline: {middle_layers} layers{uneven} "
            f"over {middle_stages} stages. Choose --num-layers divisible by --pipeline-model-parallel-size ({p}), "
            f"or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
    middle = middle_layers // middle_stages if middle_stages else 0
    sizes = [middle] * p
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def get_layer_numbers(num_layers: int, *, pipeline_model_parallel_size: int, pipeline_rank: int,
                      virtual_pipeline_model_parallel_size: Optional[int] = None, virtual_pipeline_rank: int = 0,
                      decoder_first_pipeline_num_layers: Optional[int] = None,
                      decoder_last_pipeline_num_layers: Optional[int] = None) -> range:
    """Global numbers of the layers held by chunk ``virtual_pipeline_rank`` of stage ``pipeline_rank``.

    Raises:
        ConfigError: the layers cannot be divided as asked; the message names the flags to change.
    """
    p, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if not 0 <= pipeline_rank < p or not 0 <= virtual_pipeline_rank < v:
        raise ValueError(f"pipeline rank {pipeline_rank} / virtual rank {virtual_pipeline_rank} out of range "
                         f"for {p} stages x {v} chunks.")
    sizes = _layers_per_stage(num_layers, p, decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers)
    if any(n % v for n in sizes):
        raise ConfigError(
            f"with --virtual-pipeline-model-parallel-size {v} every stage's layers must split evenly into {v} "
            f"chunks, but the stages hold {sizes} layers (--num-layers {num_layers}). Change --num-layers, "
            f"--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size, or the "
            f"--decoder-first/last-pipeline-num-layers.")
    # One trip round the ring of stages takes num_layers / v layers; chunk c is trip c.
    start = virtual_pipeline_rank * (num_layers // v) + sum(sizes[:pipeline_rank]) // v
    return range(start, start + sizes[pipeline_rank] // v)
