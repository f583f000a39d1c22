"""A checkpoint made ready to generate from: its model at this run's layout, and its tokenizer.

The checkpoint's own config gives the architecture, so only the layout (tensor and
pipeline sizes) is chosen here; the weights are resharded on load. The tokenizer is the
one the checkpoint was trained with (its config records the ``--tokenizer-*`` flags)
unless ``--tokenizer-type`` names another, so a user does not have to repeat the flags.
"""
from __future__ import annotations

import dataclasses
import os

from megatron_lite.checkpointing import CheckpointError, load_checkpoint, read_config
from megatron_lite.checkpointing.storage import TRACKER_FILE, read_latest_iteration
from megatron_lite.config import CheckpointConfig, Config, ConfigError, ParallelConfig
from megatron_lite.model.builder import build_model
from megatron_lite.tokenizer import build_tokenizer, checkpoint_tokenizer_flags


def read_checkpoint_config(load_dir: str, parallel: ParallelConfig) -> Config:
    """The checkpoint's config, to be built at the layout ``parallel`` (no sequence parallelism: a
    generation step is one token, which cannot be split over ranks)."""
    if not os.path.isdir(load_dir or ""):
        raise CheckpointError(f"--load {load_dir!r}: no such directory. Give the --save directory of a training "
                              f"run, or one written by tools/checkpoint_convert.py.")
    if read_latest_iteration(load_dir) is None:
        raise CheckpointError(f"--load {load_dir} holds no checkpoint ({TRACKER_FILE} is missing). Give the --save "
                              f"directory of a training run (the one holding {TRACKER_FILE}), or one written by "
                              f"tools/checkpoint_convert.py.")
    saved = read_config(load_dir)
    return dataclasses.replace(saved, parallel=parallel, checkpoint=CheckpointConfig(load=load_dir))


def load_model(config: Config, parallel_state):
    """This rank's model chunk with the checkpoint's weights, in eval mode."""
    if (config.parallel.virtual_pipeline_model_parallel_size or 1) > 1:
        raise ConfigError("generation runs one model chunk per pipeline stage: drop "
                          "--virtual-pipeline-model-parallel-size.")
    (model,) = build_model(config, parallel_state)
    load_checkpoint(config, parallel_state, [model], None, None)
    return model.eval()


def checkpoint_tokenizer(config: Config, given: dict):
    """The tokenizer the ``given`` ``--tokenizer-*`` flags name, or else the one the checkpoint was trained with."""
    flags = checkpoint_tokenizer_flags(dataclasses.asdict(config.data), given)
    if flags.get("tokenizer_type") is None:
        raise ConfigError("the checkpoint records no tokenizer (it was trained on --mock-data, or imported): pass "
                          "--tokenizer-type and its files (--vocab-file and --merge-file, or --tokenizer-model).")
    # A NullTokenizer's ids are data below its EOD, the model vocabulary's last id; a TikTokenizer
    # fills the model's vocabulary with its special tokens.
    null = flags["tokenizer_type"] == "NullTokenizer"
    return build_tokenizer(flags["tokenizer_type"], vocab_file=flags.get("vocab_file"),
                           merge_file=flags.get("merge_file"), tokenizer_model=flags.get("tokenizer_model"),
                           vocab_size=config.model.vocab_size - 1 if null else config.model.vocab_size,
                           tiktoken_pattern=flags.get("tiktoken_pattern"),
                           tiktoken_num_special_tokens=flags.get("tiktoken_num_special_tokens", 1000))
