"""A megatron_lite checkpoint -> a Megatron-LM checkpoint at any TP/PP, legacy or ``torch_dist``.

Both hold what Megatron-Core's local-layer GPT (``--transformer-impl local``) saves, in the
dtype of the run (``--bf16``/``--fp16``, fp32 otherwise), the vocabulary padded for the target
tensor size:

- legacy (``--ckpt-format torch``): per rank, its shard of every parameter under Megatron's
  name, layers numbered from 0 in each pipeline stage, the last stage's copy of tied
  embeddings, and ``_extra_state`` (None) for every linear layer, which Megatron's strict
  ``load_state_dict`` expects;
- ``torch_dist``: global keys, the layers stacked along a leading layer dimension under
  Transformer Engine's norm names, each rank writing its chunks (a replicated tensor once,
  by tensor-parallel rank 0; tied embeddings once, by the first stage), and an
  ``_extra_state`` object (None) per layer linear.

A mixture of experts is written as Megatron-Core's SequentialMLP (``local_experts.N``; torch_dist:
``mlp.experts.experts.*`` [layers, experts, ...]) over the target's expert-parallel ranks, with the router's
expert bias (fp32). The weights only: Megatron-LM starts the optimizer fresh.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from megatron_lite.interop.megatron import layout, legacy, torch_dist_writer
from megatron_lite.interop.megatron.args_mapping import megatron_args_from_config
from megatron_lite.checkpointing.offline import stage_model
from megatron_lite.checkpointing.resharding import CheckpointReader, has_vocab_rows, resize_vocab
from megatron_lite.checkpointing.contents import checkpoint_name, checkpointed_tensors, is_stage_copy
from megatron_lite.checkpointing.storage import CheckpointError, resolve_checkpoint_dir
from megatron_lite.config import Config, ConfigError, ParallelConfig
from megatron_lite.expert_parallel.layers import ExpertLinear
from megatron_lite.model import GPTModel
from megatron_lite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard_tensor

CKPT_FORMATS = ("torch", "torch_dist")
# What Megatron-Core 0.17's save_checkpoint records of how the model's sharded state dict was built.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


@dataclasses.dataclass
class Stage:
    """One pipeline stage of the model being exported: its (meta-device) model and global tensors."""

    pipeline_rank: int
    model: GPTModel
    full: dict  # our name -> global tensor, in the run's dtype, the vocabulary padded for the target

    @property
    def layer_offset(self) -> int:
        return min(int(n) for n in self.model.decoder.layers.keys())


def export_megatron_checkpoint(load_dir: str, save_dir: str, *, tensor_model_parallel_size: int = 1,
                               pipeline_model_parallel_size: int = 1, ckpt_format: str = "torch",
                               common_state: str = "common.pt", expert_model_parallel_size: int = 1) -> str:
    """Write ``save_dir/iter_N`` in ``ckpt_format`` (torch_dist: its common state laid out as
    ``common_state`` says) and the tracker file; returns ``save_dir``."""
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"ckpt_format must be one of {CKPT_FORMATS}, got {ckpt_format!r}")
    reader = CheckpointReader(resolve_checkpoint_dir(load_dir))
    config = Config.from_dict(reader.metadata["config"])
    if config.peft.peft == "lora":
        raise ConfigError(f"{load_dir} is an adapter checkpoint (--peft lora), which holds no base weights: add "
                          f"--merge-lora to export the base with the LoRA update merged in.")
    if config.peft.peft is not None:
        raise ConfigError(f"{load_dir} is a --peft {config.peft.peft} checkpoint, which has no Megatron-LM form: its "
                          f"weights do not merge into the base (that is LoRA's --merge-lora). It stays a megatron_lite "
                          f"checkpoint: generate, evaluate or fine-tune on with it as --load; export its base on its "
                          f"own.")
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    _check_experts(config, ckpt_format, tp, ep, load_dir)
    _check_multi_token_prediction(config, ckpt_format, pp, load_dir)
    # Re-validates heads, groups, ffn and layers against the target sizes before anything is written.
    config = dataclasses.replace(config, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                                 pipeline_model_parallel_size=pp))
    iteration = reader.metadata["iteration"]
    if os.path.exists(legacy.iteration_path(save_dir, iteration)):
        raise CheckpointError(f"{legacy.iteration_path(save_dir, iteration)} exists: a Megatron-LM export is written "
                              f"into a new directory (files left from another export would be read with it); give "
                              f"another save directory or remove that one.")
    args = megatron_args_from_config(config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     iteration=iteration, source=load_dir, ckpt_format=ckpt_format,
                                     expert_model_parallel_size=ep)
    stages = (_stage(config, reader, pipeline_rank) for pipeline_rank in range(pp))
    if ckpt_format == "torch_dist":
        _write_torch_dist(save_dir, stages, config, args, iteration, common_state, ep)
    else:
        _write_legacy(save_dir, stages, config, args, iteration, ep)
    legacy.write_tracker(save_dir, iteration)
    return save_dir


def _check_experts(config: Config, ckpt_format: str, tp: int, ep: int, load_dir: str) -> None:
    """A mixture of experts is written as Megatron-Core's SequentialMLP writes it, split over ``ep`` ranks, each
    expert split over the tensor ranks, or whole when it has biases (Megatron-Core asks for expert-tensor size 1
    then, which a legacy file cannot hold beside tensor-parallel dense layers: ``importer._read_legacy``)."""
    experts = config.model.num_experts
    if experts is None:
        if ep != 1:
            raise ConfigError(f"{load_dir} has no experts to split over --target-expert-parallel-size {ep}.")
        return
    if experts % ep:
        raise ConfigError(f"--target-expert-parallel-size {ep} does not divide the {experts} experts of {load_dir}.")
    if config.model.add_bias_linear and ckpt_format == "torch" and tp > 1:
        raise ConfigError(f"{load_dir} has experts with biases, which Megatron-LM keeps whole on each rank "
                          f"(--expert-tensor-parallel-size 1) and its legacy format cannot hold beside "
                          f"--target-tensor-parallel-size {tp}: export with --megatron-ckpt-format torch_dist, or at "
                          f"--target-tensor-parallel-size 1.")


def _check_multi_token_prediction(config: Config, ckpt_format: str, pp: int, load_dir: str) -> None:
    """Megatron-Core (0.17 to 0.20) has no torch_dist layout for tied embeddings with multi-token prediction
    over pipeline stages: its last stage's sharded state dict asserts that the output layer it holds has no
    weight. It saves and loads them in the legacy format only."""
    model = config.model
    if (ckpt_format == "torch_dist" and pp > 1 and model.mtp_num_layers is not None
            and not model.untie_embeddings_and_output_weights):
        raise ConfigError(f"{load_dir} has tied embeddings and --mtp-num-layers: Megatron-LM cannot save or load "
                          f"them as torch_dist over pipeline stages; export with --megatron-ckpt-format torch, or "
                          f"--target-pipeline-parallel-size 1.")


def _stage(config: Config, reader: CheckpointReader, pipeline_rank: int) -> Stage:
    model = stage_model(config, pipeline_rank)
    padded_vocab = config.model.padded_vocab_size(config.parallel.tensor_model_parallel_size)
    full = {}
    for name, tensor in checkpointed_tensors(model):
        # Parameters in the run's precision; the router's expert bias (a buffer) fp32, as Megatron keeps it.
        dtype = config.params_dtype if isinstance(tensor, torch.nn.Parameter) else tensor.dtype
        tensor = reader.read(checkpoint_name(model, name)).to(dtype)
        full[name] = resize_vocab(tensor, padded_vocab) if has_vocab_rows(name) else tensor
    return Stage(pipeline_rank, model, full)


def _linear_layers(model: GPTModel) -> list:
    """The names of the model's tensor-parallel linear layers (each has an ``_extra_state`` in Megatron's)."""
    return [name for name, module in model.named_modules() if isinstance(module, (ColumnParallelLinear,
                                                                                   RowParallelLinear, ExpertLinear))]


# --------------------------------------------------------------------------------------------------------------
# legacy: one model_optim_rng.pt per (tensor, pipeline) rank


def _write_legacy(save_dir: str, stages, config: Config, args, iteration: int, ep: int) -> None:
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    per_rank = (config.model.num_experts or 0) // ep
    for stage in stages:
        for tp_rank in range(tp):
            for expert_rank in range(ep):
                state = _legacy_rank_state(stage, tp_rank=tp_rank, tp=tp,
                                           experts=range(expert_rank * per_rank, (expert_rank + 1) * per_rank))
                legacy.write_rank_file(save_dir, iteration, tp_rank, stage.pipeline_rank, pp, model=state, args=args,
                                       expert_rank=expert_rank if ep > 1 else None)


def _legacy_rank_state(stage: Stage, *, tp_rank: int, tp: int, experts: range) -> dict:
    """Tensor-parallel rank ``tp_rank``'s Megatron state dict of one stage: every dense name, and the experts
    ``experts`` numbered from 0, as an expert-parallel rank's file holds them."""
    state = {}
    for name, param in checkpointed_tensors(stage.model):
        expert = layout.expert_number(name)
        if expert is not None and expert not in experts:
            continue
        tensor = stage.full[name]
        if getattr(param, "tensor_model_parallel", False):
            tensor = shard_tensor(tensor, partition_dim=param.partition_dim, partition_stride=param.partition_stride,
                                  rank=tp_rank, world_size=tp)
        if expert is not None:
            name = layout.renumbered_expert(name, -experts.start)
        state[layout.megatron_from_ours(name, stage.layer_offset)] = tensor.clone().contiguous()
    for name in _linear_layers(stage.model):
        expert = layout.expert_number(name)
        if expert is None or expert in experts:
            name = name if expert is None else layout.renumbered_expert(name, -experts.start)
            state[layout.megatron_from_ours(f"{name}._extra_state", stage.layer_offset)] = None
    if _holds_unread_output_weight(stage.model):
        state["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    return state


def _holds_unread_output_weight(model: GPTModel) -> bool:
    """Whether Megatron-Core's model of this stage has an output layer weight that it never reads: a last stage
    with tied embeddings and multi-token prediction holds the embedding (which is then the output weight) and
    an output layer of its own too. Its strict load wants it: written as the embedding."""
    return model.share_embeddings_and_output_weights and model.mtp is not None and not model.pre_process


# --------------------------------------------------------------------------------------------------------------
# torch_dist: every global rank's chunks of the global (layer-stacked) tensors


def _write_torch_dist(save_dir: str, stages, config: Config, args, iteration: int, common_state: str,
                      ep: int) -> None:
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    # Megatron's rank order: tensor rank fastest, then data-parallel (under expert parallelism the expert-parallel
    # ranks, one data-parallel rank each), then pipeline.
    ranks = [[] for _ in range(tp * ep * pp)]
    per_rank = (config.model.num_experts or 0) // ep
    keys = TorchDistKeys.of(config, args)
    for stage in stages:
        for expert_rank in range(ep):
            experts = range(expert_rank * per_rank, (expert_rank + 1) * per_rank)
            for tp_rank in range(tp):
                ranks[(stage.pipeline_rank * ep + expert_rank) * tp + tp_rank] = _torch_dist_items(
                    stage, keys, tp_rank=tp_rank, tp=tp, experts=experts, dense=expert_rank == 0)
    common = {"args": args, "checkpoint_version": legacy.CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0, "content_metadata": dict(CONTENT_METADATA)}
    torch_dist_writer.write(legacy.iteration_path(save_dir, iteration), ranks, common, common_state=common_state)


@dataclasses.dataclass(frozen=True)
class TorchDistKeys:
    """How Megatron-Core keys the model's tensors in torch_dist: the decoder's layers stacked under one key per
    name, unless they differ (--moe-layer-freq other than 1: a key per layer, as Megatron-Core's
    ``non_homogeneous_layers``); the experts stacked, each expert split over the expert-tensor ranks (the tensor
    ranks, or none: biased experts, which Megatron-Core keeps whole)."""

    sizes: dict  # stacked dimension -> its size
    layers_stacked: bool
    expert_tensor_parallel_size: int

    @classmethod
    def of(cls, config: Config, args) -> "TorchDistKeys":
        """The keys of ``config``'s model as Megatron-Core builds it from the export's ``args``."""
        freq = args.moe_layer_freq if config.model.num_experts is not None else 1
        return cls(sizes={"layers": config.model.num_layers, "experts": config.model.num_experts},
                   layers_stacked=not isinstance(freq, list) and freq == 1,
                   expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None)
                   or config.parallel.tensor_model_parallel_size)

    def key(self, name: str) -> tuple[str, tuple, tuple]:
        """(key, the tensor's offsets along the key's stacked dimensions, their sizes) of our ``name``."""
        key, where = layout.torch_dist_key(name, layers_stacked=self.layers_stacked)
        return key, tuple(position for _, position in where), tuple(self.sizes[axis] for axis, _ in where)


def _torch_dist_items(stage: Stage, keys: TorchDistKeys, *, tp_rank: int, tp: int, experts: range,
                      dense: bool) -> list:
    """What one rank of a stage writes: its chunks of the tensor-parallel tensors of the dense layers (if
    ``dense``: expert-parallel rank 0 writes them) and of ``experts``, and on tensor-parallel rank 0 their
    replicated tensors and linears' ``_extra_state`` objects."""
    items = []
    for name, param in checkpointed_tensors(stage.model):
        if is_stage_copy(stage.model, name, param) or not _written_here(name, experts, dense):
            continue  # the last stage's copy of the embedding (the first stage writes it), or another rank's
        key, index, stacked = keys.key(name)
        full = stage.full[name]
        if getattr(param, "tensor_model_parallel", False):
            split = tp if layout.expert_number(name) is None else keys.expert_tensor_parallel_size
            pieces = _tensor_parallel_chunks(full, param, tp_rank=tp_rank, tp=split) if tp_rank < split else []
        else:
            pieces = [((0,) * full.dim(), full)] if tp_rank == 0 else []
        # A layer's (an expert's) piece is a [1, ...] ([1, 1, ...]) slice of the stacked tensor.
        items += [torch_dist_writer.Chunk(key, (*stacked, *full.shape), (*index, *offsets),
                                          piece.reshape((1,) * len(index) + piece.shape)) for offsets, piece in pieces]
    if tp_rank == 0:
        for name in _linear_layers(stage.model):
            key, index, stacked = keys.key(f"{name}._extra_state")
            # Megatron-Core saves the layers' linears' extra state, not the output layer's; an object outside the
            # stacked keys at offset (0,) of shape (1,).
            if name != "output_layer" and _written_here(name, experts, dense):
                items.append(torch_dist_writer.ShardedObject(key, offset=index or (0,), shape=stacked or (1,)))
    return items


def _written_here(name: str, experts: range, dense: bool) -> bool:
    expert = layout.expert_number(name)
    return dense if expert is None else expert in experts


def _tensor_parallel_chunks(full: torch.Tensor, param, *, tp_rank: int, tp: int) -> list:
    """[(offsets, piece)] of rank ``tp_rank``'s shard of ``full``: one piece per stride block (SwiGLU's
    fc1 [gate; up] gives two), so the pieces together are ``shard_tensor``'s shard."""
    dim, stride = param.partition_dim, param.partition_stride
    block = full.shape[dim] // stride
    size = block // tp
    chunks = []
    for j in range(stride):
        start = j * block + tp_rank * size
        chunks.append((tuple(start if d == dim else 0 for d in range(full.dim())), full.narrow(dim, start, size)))
    return chunks
