import os
import sys

import pytest
import torch

# Tests run on CPU with one thread per process, like each rank of a distributed test.
torch.set_num_threads(int(os.environ.get("MEGATRON_LITE_TEST_THREADS", "1")))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run_distributed():
    from tests.distributed import run_distributed as run

    return run
