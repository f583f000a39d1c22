"""Freed host memory stays in the process on a CPU run: a step's second allocation of a large tensor
reuses the first's pages instead of faulting fresh ones in (counted, not timed)."""
import subprocess
import sys

import pytest

# Page faults of allocating and filling a 64 MiB tensor after one of the same size was freed, with
# glibc's defaults and then after keep_freed_memory (in a process of its own: the setting is global).
PROBE = """
import resource, torch
from megatron_lite.training import host_memory

def faults():
    torch.empty(1 << 24).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(1 << 24).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
print(host_memory.keep_freed_memory(), default, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_blocks_are_reused_instead_of_refaulted():
    kept, default, kept_faults = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True,
                                                text=True).stdout.split()
    if kept != "True":
        pytest.skip("the C library has no mallopt (not glibc)")
    pages = (1 << 26) // 4096
    assert int(default) > pages // 2  # glibc's default: every page of the fresh mapping faults in
    assert int(kept_faults) < pages // 20
