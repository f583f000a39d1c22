"""A checkpoint made ready to generate from: its model at this run's layout, and its tokenizer.

The checkpoint's own config gives the architecture, so only the layout (tensor and
pipeline sizes) is chosen here; the weights are resharded on load. The tokenizer is the
one the checkpoint was trained with (its config records the ``--tokenizer-*`` flags)
unless flags name another, so a user does not have to repeat them.
"""
from __future__ import annotations

import dataclasses
import os

from megatron_lite.checkpointing import CheckpointError, load_checkpoint, read_config
from megatron_lite.checkpointing.storage import TRACKER_FILE, read_latest_iteration
from megatron_lite.config import CheckpointConfig, Config, ConfigError, ParallelConfig
from megatron_lite.model.builder import build_model
from megatron_lite.tokenizer import build_tokenizer

# The tokenizer's fields of DataConfig, with their flags; the last three name files.
TOKENIZER_FLAGS = {"tokenizer_type": "--tokenizer-type", "vocab_file": "--vocab-file", "merge_file": "--merge-file",
                   "tokenizer_model": "--tokenizer-model"}


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


def checkpoint_tokenizer(config: Config, **flags):
    """The tokenizer the ``--tokenizer-*`` ``flags`` name (values of None are not given), the
    checkpoint's recorded ones filling in the rest."""
    data = config.data
    chosen = {name: flags.get(name) if flags.get(name) is not None else getattr(data, name)
              for name in TOKENIZER_FLAGS}
    if chosen["tokenizer_type"] is None:
        raise ConfigError("the checkpoint records no tokenizer (it was trained on --mock-data, or imported): pass "
                          "--tokenizer-type and its files (--vocab-file and --merge-file, or --tokenizer-model).")
    # A NullTokenizer's ids are data below its EOD, the model vocabulary's last id.
    vocab_size = config.model.vocab_size - 1 if chosen["tokenizer_type"] == "NullTokenizer" else None
    try:
        return build_tokenizer(chosen["tokenizer_type"], vocab_file=chosen["vocab_file"],
                               merge_file=chosen["merge_file"], tokenizer_model=chosen["tokenizer_model"],
                               vocab_size=vocab_size)
    except ConfigError as error:
        gone = [f"{TOKENIZER_FLAGS[name]} {chosen[name]}" for name in ("vocab_file", "merge_file", "tokenizer_model")
                if flags.get(name) is None and chosen[name] and not os.path.exists(chosen[name])]
        if not gone:
            raise
        raise ConfigError(f"the checkpoint was trained with --tokenizer-type {chosen['tokenizer_type']} and "
                          f"{', '.join(gone)}, which no longer exist here: pass the tokenizer flags "
                          f"(--tokenizer-type, and --vocab-file and --merge-file, or --tokenizer-model) with "
                          f"where its files are now.") from error
