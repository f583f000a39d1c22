import pytest
import torch
import torch.distributed as dist

from tests.distributed import DistributedTestError, run_distributed


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), torch.get_num_threads()


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()


def _deadlocks(rank, world_size):
    if rank == 0:
        dist.barrier()
    else:
        import time

        time.sleep(600)  # never reaches the barrier: rank 0 waits forever


def test_runs_real_collectives():
    results = run_distributed(_sum_of_ranks, world_size=4)
    assert results == [(6.0, 1)] * 4


def test_failing_rank_traceback_is_reported():
    with pytest.raises(DistributedTestError, match="rank 1 of 2 failed(.|\n)*boom on rank one"):
        run_distributed(_fails_on_rank_one, world_size=2, timeout=60)


def test_deadlock_fails_fast():
    with pytest.raises(DistributedTestError, match="did not finish within 3s"):
        run_distributed(_deadlocks, world_size=2, timeout=3)


def _tensor_result(rank, world_size):
    return torch.full((1000,), float(rank))


def _exits_without_reporting(rank, world_size):
    import os

    if rank == 1:
        os._exit(3)  # like a segfault: no traceback, no result
    dist.barrier()


def test_tensor_results_outlive_their_rank():
    results = run_distributed(_tensor_result, world_size=2)
    assert [r.sum().item() for r in results] == [0.0, 1000.0]


def test_rank_dying_silently_is_reported_as_such():
    with pytest.raises(DistributedTestError, match=r"exited without a result \(exit codes \{.*1: 3"):
        run_distributed(_exits_without_reporting, world_size=2, timeout=60)
