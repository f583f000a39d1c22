"""Run by torchrun (test_clean_exit): ``pretrain_gpt``'s main with its arguments, then whether the WORLD process
group outlived its teardown. A group alive at interpreter shutdown keeps gloo's threads running into it, where a
rank can abort with "terminate called without an active exception" after a finished run."""
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


if __name__ == "__main__":
    dist.destroy_process_group = _destroy_noting_the_world_group
    code = main(sys.argv[1:])
    freed = bool(world) and all(group() is None for group in world)
    print(f"rank {os.environ['RANK']}: WORLD group freed after teardown: {freed}")
    sys.exit(code if code else int(not freed))
