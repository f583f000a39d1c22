"""Size a run before you have the machine: ``python tools/plan.py [flags]`` is ``python -m megatron_lite.plan``."""
import sys

from megatron_lite.plan import main

if __name__ == "__main__":
    sys.exit(main())
