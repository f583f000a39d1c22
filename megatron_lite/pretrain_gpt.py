"""Entry point: ``python -m megatron_lite.pretrain_gpt [Megatron-LM flags]`` (also under torchrun/srun).

A user error (flags, data files, checkpoints) prints once as ``error: ...`` and exits 2;
a bug keeps its traceback (``process_groups.failures.run_command``).

``--sft`` fine-tunes on prompt/response or chat data (``--train-data-path``) with the same loop, usually
from ``--pretrained-checkpoint CKPT`` or ``--load CKPT --finetune``.
"""
import sys

from megatron_lite.checkpointing.preflight import check_peft_has_a_base
from megatron_lite.cli.arguments import parse_args
from megatron_lite.process_groups.failures import run_command
from megatron_lite.training.loop import pretrain


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: pretrain(_checked(parse_args(argv))))


def _checked(config):
    """What the command line refuses beyond the Config API (which tests drive): --peft on random weights."""
    check_peft_has_a_base(config)
    return config


if __name__ == "__main__":
    sys.exit(main())
