"""A megatron_lite checkpoint -> a Megatron-LM legacy (``--ckpt-format torch``) checkpoint at any TP/PP.

Each rank's file holds what Megatron-Core's local-layer GPT (``--transformer-impl local``)
saves: its shard of every parameter under Megatron's name, layers numbered from 0 in each
pipeline stage, the last stage's copy of tied embeddings, the vocabulary padded for the
target tensor size, and ``_extra_state`` (None) for every linear layer, which Megatron's
strict ``load_state_dict`` expects. The weights only: Megatron-LM starts the optimizer fresh.
"""
from __future__ import annotations

import dataclasses

from megatron_lite.checkpointing.megatron import layout, legacy
from megatron_lite.checkpointing.megatron.args_mapping import megatron_args_from_config
from megatron_lite.checkpointing.offline import stage_model
from megatron_lite.checkpointing.resharding import CheckpointReader, has_vocab_rows, resize_vocab
from megatron_lite.checkpointing.save_load import checkpoint_name
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir
from megatron_lite.config import Config, ConfigError, ParallelConfig
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard_tensor


def export_megatron_checkpoint(load_dir: str, save_dir: str, *, tensor_model_parallel_size: int = 1,
                               pipeline_model_parallel_size: int = 1) -> str:
    """Write ``save_dir/iter_N/mp_rank_*/model_optim_rng.pt`` and its tracker file; returns ``save_dir``."""
    reader = CheckpointReader(resolve_checkpoint_dir(load_dir))
    config = Config.from_dict(reader.metadata["config"])
    if config.peft.peft is not None:
        raise ConfigError(f"{load_dir} is a --peft {config.peft.peft} checkpoint: merge it into its base first "
                          f"(--merge-lora or --fold-prefix-projection), then export the result.")
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    # Re-validates heads, groups, ffn and layers against the target sizes before anything is written.
    config = dataclasses.replace(config, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                                 pipeline_model_parallel_size=pp))
    iteration = reader.metadata["iteration"]
    args = megatron_args_from_config(config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     iteration=iteration, source=load_dir)
    for pipeline_rank in range(pp):
        model = stage_model(config, pipeline_rank)
        layer_offset = min(int(n) for n in model.decoder.layers.keys())
        full = {name: reader.read(checkpoint_name(model, name)).to(config.params_dtype)
                for name, _ in model.named_parameters()}
        for tp_rank in range(tp):
            state = _rank_state(model, full, config, tp_rank=tp_rank, layer_offset=layer_offset)
            legacy.write_rank_file(save_dir, iteration, tp_rank, pipeline_rank, pp, model=state, args=args)
    legacy.write_tracker(save_dir, iteration)
    return save_dir


def _rank_state(model, full: dict, config: Config, *, tp_rank: int, layer_offset: int) -> dict:
    """Tensor-parallel rank ``tp_rank``'s Megatron state dict of one stage (every rank holds every name)."""
    tp = config.parallel.tensor_model_parallel_size
    padded_vocab = config.model.padded_vocab_size(tp)
    state = {}
    for name, param in model.named_parameters():
        tensor = resize_vocab(full[name], padded_vocab) if has_vocab_rows(name) else full[name]
        if getattr(param, "tensor_model_parallel", False):
            tensor = shard_tensor(tensor, partition_dim=param.partition_dim, partition_stride=param.partition_stride,
                                  rank=tp_rank, world_size=tp)
        state[layout.megatron_from_ours(name, layer_offset)] = tensor.clone().contiguous()
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            state[layout.megatron_from_ours(f"{name}._extra_state", layer_offset)] = None
    return state
