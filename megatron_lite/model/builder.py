"""Building the model chunks a rank holds: training, generation and conversion all start here.

Which layers a chunk holds comes from the pipeline split (``layer_split``); whether it
has the embedding (``pre_process``) or the output layer (``post_process``) from its
place in the pipeline. Initialisation does not depend on the layout, so any layout
builds the same global model.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_lite.config import Config, ParallelConfig
from megatron_lite.context_parallel import ContextParallelConfig
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.model.embedding import LanguageModelEmbedding
from megatron_lite.model.gpt_model import GPTModel
from megatron_lite.model.transformer_layer import TransformerLayer
from megatron_lite.model.weight_init import initialize_weights
from megatron_lite.peft import apply_peft
from megatron_lite.pipeline_parallel.layer_split import get_layer_numbers
from megatron_lite.process_groups.parallel_state import ParallelState, mock_parallel_state
from megatron_lite.tensor_parallel import TensorParallelConfig


# What ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params) gathers one at a time: the
# embedding and each transformer layer; the final norm and output layer form the remaining unit.
FSDP_UNIT_MODULES = (LanguageModelEmbedding, TransformerLayer)


def build_model_chunk(config: Config, parallel_state: ParallelState, *, pipeline_rank: int,
                      virtual_rank: int = 0, whole_sequences: bool = False) -> GPTModel:
    """Model chunk ``virtual_rank`` of pipeline stage ``pipeline_rank``, uninitialised; with --peft, its base
    frozen and the PEFT weights added. ``whole_sequences``: the model runs whole sequences whatever the
    layout's context-parallel size (generation splits only a prompt's prefill, in its key/value cache)."""
    parallel, training = config.parallel, config.training
    pp = parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    layers = get_layer_numbers(
        config.model.num_layers, pipeline_model_parallel_size=pp, pipeline_rank=pipeline_rank,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        virtual_pipeline_rank=virtual_rank,
        decoder_first_pipeline_num_layers=parallel.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=parallel.decoder_last_pipeline_num_layers)
    model = GPTModel(
        config.model, tensor_parallel_config(config, parallel_state), layer_numbers=layers,
        context_parallel=None if whole_sequences else context_parallel_config(config, parallel_state),
        pre_process=pipeline_rank == 0 and virtual_rank == 0,
        post_process=pipeline_rank == pp - 1 and virtual_rank == vpp - 1,
        recompute_granularity=training.recompute_granularity, recompute_method=training.recompute_method,
        recompute_num_layers=training.recompute_num_layers,
        ep_config=ExpertParallelConfig(ep_group=parallel_state.expert_model_parallel_group,
                                       etp_group=parallel_state.expert_tensor_parallel_group))
    apply_peft(model, config)
    return model


def tensor_parallel_config(config: Config, parallel_state: ParallelState) -> TensorParallelConfig:
    """What every tensor-parallel layer of this rank's model is told: made here once, handed down."""
    return TensorParallelConfig(tp_group=parallel_state.tensor_model_parallel_group,
                                sequence_parallel=config.parallel.sequence_parallel, params_dtype=config.params_dtype)


def context_parallel_config(config: Config, parallel_state: ParallelState) -> ContextParallelConfig | None:
    """What every attention layer of this rank's model is told about context parallelism (None without it)."""
    return ContextParallelConfig.of_layout(parallel_state, tuple(config.parallel.cp_comm_type))


def build_model(config: Config, parallel_state: ParallelState, *, whole_sequences: bool = False) -> list[GPTModel]:
    """The initialised model chunks this rank holds (one, or one per virtual stage), on its device
    (``whole_sequences`` as ``build_model_chunk``'s)."""
    vpp = config.parallel.virtual_pipeline_model_parallel_size or 1
    chunks = [build_model_chunk(config, parallel_state, pipeline_rank=parallel_state.pipeline_model_parallel_rank,
                                virtual_rank=virtual_rank, whole_sequences=whole_sequences)
              for virtual_rank in range(vpp)]
    initialize_weights(chunks, config.model, parallel_state, seed=config.training.seed)
    return [chunk.to(current_device()) for chunk in chunks]


def current_device() -> torch.device:
    """This process's GPU when there is one (initialize_distributed set it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """The model's parameters, counted without tensor parallelism; a tied embedding is held by the first
    and the last pipeline stage, so ``per_stage`` counts it twice and ``total`` once."""

    per_stage: list[int]  # each pipeline stage's (virtual stages together)
    total: int
    trainable: int  # all of them without --peft


def count_parameters(config: Config) -> ParameterCounts:
    """Counts the model of ``config`` (PEFT weights included) from one build of every pipeline stage on the
    meta device, so nothing is allocated."""
    whole_stages = dataclasses.replace(config, parallel=ParallelConfig(
        pipeline_model_parallel_size=config.parallel.pipeline_model_parallel_size,
        decoder_first_pipeline_num_layers=config.parallel.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=config.parallel.decoder_last_pipeline_num_layers))
    with torch.device("meta"):
        stages = [build_model_chunk(whole_stages, mock_parallel_state(0, 1), pipeline_rank=rank)
                  for rank in range(config.parallel.pipeline_model_parallel_size)]
    # A later stage's copy of the tied embedding is the first stage's weight again (GPTModel marks both copies).
    owned = [[p for p in stage.parameters() if rank == 0 or not getattr(p, "shared_embedding", False)]
             for rank, stage in enumerate(stages)]
    return ParameterCounts(
        per_stage=[sum(p.numel() for p in stage.parameters()) for stage in stages],
        total=sum(p.numel() for params in owned for p in params),
        trainable=sum(p.numel() for params in owned for p in params if p.requires_grad))
