"""A checkpoint made ready to generate from: its model at this run's layout, and its tokenizer.

The checkpoint's own config gives the architecture, so only the layout (tensor, pipeline and
expert sizes; the processes beyond them are data-parallel ranks) is chosen here; the weights are
resharded on load. The tokenizer is the
one the checkpoint was trained with (its config records the ``--tokenizer-*`` flags)
unless ``--tokenizer-type`` names another, so a user does not have to repeat the flags.
"""
from __future__ import annotations

import dataclasses
import os

from megatron_lite.checkpointing import CheckpointError, load_checkpoint, read_config
from megatron_lite.interop.megatron.importer import as_megatron_lite_checkpoint
from megatron_lite.checkpointing.storage import TRACKER_FILE, read_latest_iteration
from megatron_lite.config import CheckpointConfig, Config, ConfigError, GRPOConfig, ParallelConfig
from megatron_lite.model.builder import build_model
from megatron_lite.process_groups.initialize import initialize_distributed
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.config import TOKENIZER_TYPES
from megatron_lite.tokenizer import build_model_tokenizer, checkpoint_tokenizer_flags


def read_checkpoint_config(load_dir: str, parallel: ParallelConfig) -> Config:
    """The checkpoint's config, to be built at the layout ``parallel`` (no sequence parallelism: a
    generation step is one token, which cannot be split over ranks)."""
    if not os.path.isdir(load_dir or ""):
        raise CheckpointError(f"--load {load_dir!r}: no such directory. Give the --save directory of a training "
                              f"run, or one written by tools/checkpoint_convert.py.")
    load_dir = as_megatron_lite_checkpoint(load_dir)  # a Megatron-LM checkpoint: its import
    if read_latest_iteration(load_dir) is None:
        raise CheckpointError(f"--load {load_dir} holds no checkpoint ({TRACKER_FILE} is missing). Give the --save "
                              f"directory of a training run (the one holding {TRACKER_FILE}), or one written by "
                              f"tools/checkpoint_convert.py.")
    saved = read_config(load_dir)
    # Sampling has its own --seed: the training ranks' random-number states mean nothing here, and loading
    # them would warn about a layout change that generation does not care about. How the weights were trained
    # (--dpo's or --grpo's reference and rewards) is no part of running them.
    return dataclasses.replace(saved, parallel=parallel, checkpoint=CheckpointConfig(load=load_dir, no_load_rng=True),
                               data=dataclasses.replace(saved.data, dpo=False, grpo=False), grpo=GRPOConfig(),
                               training=dataclasses.replace(saved.training, dpo_precompute_ref_log_probs=False))


def add_layout_arguments(parser) -> None:
    """The layout flags of a command running a checkpoint's model, as the trainer names them."""
    parallel = parser.add_argument_group(
        "parallelism (launch with torchrun: processes beyond tensor x pipeline are data-parallel ranks, which "
        "split the work; experts are split over the data-parallel ranks)")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-tensor-parallel-size", type=int,
                          help="tensor-parallel size of the experts (default: --tensor-model-parallel-size)")


def layout_of(args) -> ParallelConfig:
    """The ParallelConfig of ``add_layout_arguments``' flags (checked as the trainer checks them)."""
    return ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                          pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                          context_parallel_size=getattr(args, "context_parallel_size", 1),
                          expert_model_parallel_size=args.expert_model_parallel_size,
                          expert_tensor_parallel_size=args.expert_tensor_parallel_size)


def model_parallel_state(parallel: ParallelConfig):
    """Join the job's processes and build this rank's groups for the layout ``parallel``."""
    env = initialize_distributed(parallel)
    parallel.data_parallel_size(env.world_size)  # the launch fits the layout, or one error says how
    return initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                     context_parallel_size=parallel.context_parallel_size,
                                     expert_model_parallel_size=parallel.expert_model_parallel_size,
                                     expert_tensor_parallel_size=parallel.expert_tensor_parallel_size)


def load_model(config: Config, parallel_state):
    """This rank's model chunk with the checkpoint's weights, in eval mode (on a CPU, with its matrices stored
    for decoding: ``store_for_decoding``). It runs whole sequences: under context parallelism generation
    splits only the prefill (``inference/text_generation.py``)."""
    if (config.parallel.virtual_pipeline_model_parallel_size or 1) > 1:
        raise ConfigError("generation runs one model chunk per pipeline stage: drop "
                          "--virtual-pipeline-model-parallel-size.")
    (model,) = build_model(config, parallel_state, whole_sequences=True)
    load_checkpoint(config, parallel_state, [model], None, None)
    if next(model.parameters()).device.type == "cpu":
        store_for_decoding(model)
    return model.eval()


def store_for_decoding(model) -> None:
    """Stores every weight matrix [out, in] column by column (its transpose contiguous), shapes unchanged.

    A decoding step multiplies a few rows (one token per sequence) by each weight; on a CPU, BLAS does
    that up to twice as fast with a contiguous [in, out] matrix as with the transpose of a row-major
    [out, in] one (the output layer at batch 1 most: it is most of a small model's step). The results
    are the same products; only the memory order of the weights changes."""
    for param in model.parameters():
        if param.dim() == 2:
            param.data = param.data.t().contiguous().t()


def add_tokenizer_arguments(parser) -> None:
    """The ``--tokenizer-*`` flags (``TOKENIZER_FIELDS``) of a command reading a checkpoint, which records its own."""
    tokenizer = parser.add_argument_group("tokenizer (default: the one the checkpoint was trained with)")
    tokenizer.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    tokenizer.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    tokenizer.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    tokenizer.add_argument("--tokenizer-model", help="SentencePieceTokenizer's .model, HuggingFaceTokenizer's "
                                                     "tokenizer.json (or its directory)")


def checkpoint_tokenizer(config: Config, given: dict):
    """The tokenizer the ``given`` ``--tokenizer-*`` flags name, or else the one the checkpoint was trained with."""
    flags = checkpoint_tokenizer_flags(dataclasses.asdict(config.data), given)
    if flags.get("tokenizer_type") is None:
        raise ConfigError("the checkpoint records no tokenizer (it was trained on --mock-data, or imported from a "
                          "directory without tokenizer files): pass "
                          "--tokenizer-type and its files (--vocab-file and --merge-file, or --tokenizer-model).")
    return build_model_tokenizer(flags, config.model.vocab_size)
