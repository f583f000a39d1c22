"""Entry point: ``python -m megatron_lite.pretrain_gpt [Megatron-LM flags]`` (also under torchrun/srun)."""
import sys

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.training import pretrain


def main(argv: list[str] | None = None) -> int:
    try:
        pretrain(parse_args(argv))
    except ConfigError as error:  # bad flags: say which and how to fix, before any collective
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
