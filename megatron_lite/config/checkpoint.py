"""CheckpointConfig: where checkpoints are saved and loaded from, and what a load restores."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_lite.config.fields import check_choices, require


@dataclass(kw_only=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    pretrained_checkpoint: Optional[str] = None
    use_checkpoint_args: bool = False
    # Write checkpoints in a background thread while training goes on (checkpointing/async_save.py).
    async_save: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        require(not self.async_save or self.save is not None, "--async-save needs --save DIR to write to.")
        require(self.save_interval is None or self.save_interval >= 1,
                 f"--save-interval must be >= 1, got {self.save_interval}.")
        require(self.save_interval is None or self.save is not None,
                 "--save-interval needs --save DIR to know where to write checkpoints.")
        require(not self.use_checkpoint_args or bool(self.load or self.pretrained_checkpoint),
                 "--use-checkpoint-args needs --load or --pretrained-checkpoint: the checkpoint whose model to use.")
        # Saving into the base would point its latest at the fine-tune's checkpoints (a PEFT run's: adapters
        # only), so a later run from that base silently starts from them.
        require(not (self.save and self.pretrained_checkpoint
                      and os.path.realpath(self.save) == os.path.realpath(self.pretrained_checkpoint)),
                 f"--save {self.save} is the --pretrained-checkpoint directory: the fine-tune's checkpoints would "
                 f"replace the base as its latest. Give --save (and --load, to resume) a directory of their own.")
