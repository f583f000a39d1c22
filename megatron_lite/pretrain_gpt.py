"""Entry point: ``python -m megatron_lite.pretrain_gpt [Megatron-LM flags]`` (also under torchrun/srun)."""
import sys

from megatron_lite.config.arguments import parse_args
from megatron_lite.checkpointing import CheckpointError
from megatron_lite.config import ConfigError
from megatron_lite.data.indexed_dataset import IndexedDatasetError
from megatron_lite.training.loop import pretrain

# Errors about the user's input (flags, data files, checkpoints): their message says what to fix,
# so print it alone; anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, IndexedDatasetError, CheckpointError)


def main(argv: list[str] | None = None) -> int:
    try:
        pretrain(parse_args(argv))
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
