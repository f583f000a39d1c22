"""A Megatron-LM checkpoint (legacy or torch_dist) -> megatron_lite's global tensors and Config."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import tempfile

import torch

from megatron_lite.interop.megatron import layout, legacy, torch_dist
from megatron_lite.interop.megatron.args_mapping import config_from_megatron_args, model_config_from_megatron_args
from megatron_lite.checkpointing.offline import stage_model, write_checkpoint
from megatron_lite.checkpointing.contents import checkpointed_tensors
from megatron_lite.checkpointing.resharding import has_vocab_rows, resize_vocab
from megatron_lite.checkpointing.storage import CheckpointError, read_latest_iteration
from megatron_lite.config import Config, ParallelConfig
from megatron_lite.tensor_parallel import gather_shards


def detect_format(path: str) -> str:
    """'torch' (legacy) or 'torch_dist' for a Megatron checkpoint root or iteration directory."""
    directory = legacy.iteration_dir(path)
    if legacy.has_rank_files(directory):
        return "torch"
    if torch_dist.is_torch_dist(directory):
        return "torch_dist"
    raise CheckpointError(f"{path} is not a Megatron-LM checkpoint: it has neither mp_rank_* directories "
                          f"(--ckpt-format torch) nor a torch.distributed.checkpoint .metadata (torch_dist).")


@dataclasses.dataclass
class MegatronCheckpoint:
    """What megatron_lite takes from a Megatron-LM checkpoint."""

    config: Config  # model and precision from the saved args; parallel sizes 1 (any layout loads it)
    iteration: int
    tensors: dict  # our global name -> tensor in the checkpoint's precision, the vocabulary at config's size
    ckpt_format: str
    args: object  # Megatron's saved args (argparse.Namespace with stand-ins)


def read_megatron_checkpoint(path: str) -> MegatronCheckpoint:
    """Read a Megatron checkpoint root or ``iter_*`` directory into global tensors."""
    ckpt_format = detect_format(path)
    directory = legacy.iteration_dir(path)
    if ckpt_format == "torch":
        args, iteration, tensors = _read_legacy(directory)
    else:
        args, iteration, tensors = torch_dist.read(directory)
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        tensors = {layout.ours_from_megatron(name, 0): t for name, t in tensors.items()
                   if not layout.is_ignored(name, tied=tied)}
    config = config_from_megatron_args(args, path)
    # Megatron's padded rows, or for a model we exported (its unpadded size in the args) the rows of its vocabulary.
    tensors = {name: resize_vocab(t, config.model.vocab_size) if has_vocab_rows(name) else t
               for name, t in tensors.items()}
    tensors = _checked(tensors, config, path)
    return MegatronCheckpoint(config, iteration, tensors, ckpt_format, args)


def _read_legacy(directory: str) -> tuple:
    files = legacy.rank_files(directory)
    tp, pp, ep = (1 + max(ranks[axis] for ranks in files) for axis in range(3))
    missing = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in files]
    if missing:
        raise CheckpointError(f"{directory} lacks the files of (tensor, pipeline, expert) ranks {missing}.")
    first = legacy.read_rank_file(files[0, 0, 0])
    args = first["args"]
    if getattr(args, "num_experts", None) and (getattr(args, "expert_tensor_parallel_size", None) or tp) != tp:
        # Megatron-LM's legacy save names a file by its dense tensor rank and expert rank only, and every rank of
        # expert-data rank 0 writes one: under another expert-tensor size two ranks can share a name (tensor size
        # 1, expert-tensor size 2: both write mp_rank_00) or (tensor, expert) pairs have none.
        raise CheckpointError(f"{directory} splits its experts over --expert-tensor-parallel-size "
                              f"{args.expert_tensor_parallel_size} ranks, not the tensor-parallel {tp}: megatron_lite "
                              f"reads legacy files whose experts are split like the dense layers; save it with "
                              f"--ckpt-format torch_dist (whole tensors, read at any expert-tensor size).")
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    model = stage_model(Config(model=model_config_from_megatron_args(args, directory)), 0)
    params = dict(model.named_parameters())
    experts_per_rank = (getattr(args, "num_experts", None) or 0) // ep
    tensors, layer_offset = {}, 0
    for stage in range(pp):
        shards: dict = {}
        for rank in range(tp):
            for expert_rank in range(ep):
                key = (rank, stage, expert_rank)
                state = first if key == (0, 0, 0) else legacy.read_rank_file(files[key])
                for name, tensor in _named_tensors(state, experts_per_rank, args.hidden_size):
                    if tensor is None or layout.is_ignored(name, tied=tied):
                        continue
                    if layout.expert_number(name) is not None:
                        shards.setdefault(layout.renumbered_expert(name, expert_rank * experts_per_rank),
                                          []).append(tensor)
                    elif expert_rank == 0:  # the dense weights are in every expert rank's file, alike
                        shards.setdefault(name, []).append(tensor)
        layers = {layout.local_layer(name)[0] for name in shards if layout.local_layer(name)}
        for name, pieces in shards.items():
            ours = layout.ours_from_megatron(name, layer_offset)
            tensors[ours] = _merged(pieces, params.get(ours))
        layer_offset += len(layers)
    return args, first.get("iteration", 0), tensors


def _named_tensors(state: dict, local_experts: int, hidden_size: int):
    """(Megatron's name, tensor) of a rank file's model, grouped-GEMM experts as SequentialMLP's."""
    for name, tensor in layout.flatten(state["model"]).items():
        if tensor is None:
            continue
        yield from layout.as_sequential_mlp(name, tensor, local_experts=local_experts, hidden_size=hidden_size)


def _merged(pieces: list, param) -> torch.Tensor:
    """One tensor from its tensor-parallel shards, split like our ``param`` (replicated: rank 0's copy)."""
    if param is None or not getattr(param, "tensor_model_parallel", False) or len(pieces) == 1:
        return pieces[0]
    return gather_shards(pieces, partition_dim=param.partition_dim, partition_stride=param.partition_stride)


def _checked(tensors: dict, config: Config, source: str) -> dict:
    """Our model's tensors in the checkpoint's precision, after checking that the names and shapes are exactly
    our model's."""
    params = dict(checkpointed_tensors(stage_model(dataclasses.replace(config, model=dataclasses.replace(
        config.model, make_vocab_size_divisible_by=1)), 0)))
    unknown, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
    if unknown or missing:
        raise CheckpointError(f"{source}: Megatron tensors not understood {unknown[:4]}, missing {missing[:4]}: "
                              f"a model megatron_lite does not implement, or a layout it does not know.")
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {tuple(p.shape)})" for n, p in params.items()
             if tuple(tensors[n].shape) != tuple(p.shape)]
    if wrong:
        raise CheckpointError(f"{source}: tensors whose shapes do not match the saved args: {wrong[:3]}")
    # Parameters in the run's precision; buffers (the router's expert bias, fp32 in Megatron and ours) as ours.
    return {name: t.to(config.params_dtype if isinstance(params[name], torch.nn.Parameter) else params[name].dtype)
            .contiguous() for name, t in tensors.items()}


def import_megatron_checkpoint(load_dir: str, save_dir: str, *, tensor_model_parallel_size: int = 1,
                               pipeline_model_parallel_size: int = 1) -> str:
    """A Megatron-LM checkpoint -> a weights-only megatron_lite checkpoint at the given layout
    (its iteration kept; the optimizer starts fresh)."""
    checkpoint = read_megatron_checkpoint(load_dir)
    config = dataclasses.replace(checkpoint.config, parallel=ParallelConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size))
    return write_checkpoint(save_dir, config, checkpoint.tensors.__getitem__, iteration=checkpoint.iteration)


def is_megatron_checkpoint(path: str) -> bool:
    directory = legacy.iteration_dir(path) if path and os.path.isdir(path) else ""
    return bool(directory) and (legacy.has_rank_files(directory) or torch_dist.is_torch_dist(directory))


def as_megatron_lite_checkpoint(path: str) -> str:
    """``path`` itself, or for a Megatron-LM checkpoint its import (at tensor/pipeline size 1; any layout
    loads it), made once into a cache directory keyed by the checkpoint's path and modification time.

    Every rank of a job calls this before process groups exist; a file lock makes one of them
    import while the others wait, then all read the same import.
    """
    if not is_megatron_checkpoint(path):
        return path
    directory = legacy.iteration_dir(path)
    key = hashlib.sha256(f"{os.path.abspath(directory)}:{os.stat(directory).st_mtime_ns}".encode()).hexdigest()
    cache = os.path.join(tempfile.gettempdir(), "megatron_lite", "megatron_imports")  # $TMPDIR moves it
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, key[:16])
    with open(os.path.join(cache, f"{key[:16]}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if read_latest_iteration(target) is None:
            shutil.rmtree(target, ignore_errors=True)
            import_megatron_checkpoint(path, target)
    return target
