"""``pretrain_gpt``'s main with its arguments, then whether the WORLD process group outlived its teardown. A group
alive at interpreter shutdown keeps gloo's threads running into it, where a rank can abort with "terminate called
without an active exception" after a finished (test_clean_exit, under torchrun) or a failed run
(test_user_errors)."""
import os
import sys
import weakref

import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_lite.pretrain_gpt import main

_destroy_process_group = dist.destroy_process_group
world = []


def _destroy_noting_the_world_group(group=None):
    if group is None:  # the teardown of everything: WORLD is the default group
        world.append(weakref.ref(distributed_c10d._get_default_group()))
    _destroy_process_group(group)


def main_noting_the_world_group(argv: list[str]) -> int:
    """main's exit code, or 1 if it exited 0 but left the WORLD group alive; prints whether it was freed."""
    dist.destroy_process_group = _destroy_noting_the_world_group
    code = main(argv)
    freed = bool(world) and all(group() is None for group in world)
    print(f"rank {os.environ['RANK']}: WORLD group freed after teardown: {freed}")
    return code if code else int(not freed)


if __name__ == "__main__":
    sys.exit(main_noting_the_world_group(sys.argv[1:]))
