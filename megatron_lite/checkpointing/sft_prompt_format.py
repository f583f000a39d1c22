"""A fine-tuning run keeps the chat template of the checkpoint it continues.

The template decides which ids the model sees and which of them the loss covers: a run resumed
from a chatml checkpoint that fell back to ``plain`` trained a different task (the loss jumped from
0.79 to 7.74) and saved the damage as its newest checkpoint. So, as the tokenizer: with no
--sft-tokenizer-prompt-format, a run that starts from a fine-tuned checkpoint (resume or
--pretrained-checkpoint) takes the checkpoint's; a resume that names another is refused, since it
continues the same run on the same data. A new fine-tune (--finetune, or --pretrained-checkpoint
while --load is empty) that names a format chooses it.
"""
from __future__ import annotations

from megatron_lite.checkpointing.loading import checkpoint_to_load, read_config
from megatron_lite.checkpointing.storage import CheckpointError
from megatron_lite.config import CheckpointConfig, ConfigError


def prompt_format_from_checkpoint(values: dict) -> dict:
    """``{"sft_tokenizer_prompt_format": ...}`` taken from the checkpoint to load, or {} (parsed flags by
    field name, as ``cli.arguments`` holds them; rank-independent, read before any process group)."""
    if not values.get("sft"):
        return {}
    checkpoint = CheckpointConfig(**{name: values[name] for name in ("load", "pretrained_checkpoint", "finetune")
                                     if name in values})
    try:
        source = checkpoint_to_load(checkpoint)
        saved = None if source is None else read_config(source[0]).data
    except CheckpointError:  # a missing or unreadable checkpoint: the load reports it, with its fix
        return {}
    if saved is None or not saved.sft:  # a fresh start, or a pretrained base: the command line decides
        return {}
    root, _, finetune = source
    given, recorded = values.get("sft_tokenizer_prompt_format"), saved.sft_tokenizer_prompt_format
    if given is None:
        return {"sft_tokenizer_prompt_format": recorded}
    if given != recorded and not finetune:
        raise ConfigError(f"--sft-tokenizer-prompt-format {given} differs from {recorded}, the format the checkpoint "
                          f"in --load {root} was fine-tuned with: a resumed run keeps its chat template. Drop the "
                          f"flag (or give {recorded}); to fine-tune it anew with {given}, add --finetune.")
    return {}
