"""DistributedSignalHandler: a signal is recorded, not fatal, and every rank agrees on it."""
import os
import signal

import pytest

from megatron_lite.process_groups.parallel_state import initialize_model_parallel, mock_parallel_state
from megatron_lite.training.signal_handler import DistributedSignalHandler

SINGLE = mock_parallel_state(rank=0, world_size=1)


def test_records_the_signal_and_restores_the_previous_handler():
    def previous(signum, frame):
        raise AssertionError("the previous handler must not run while the context is active")

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        with DistributedSignalHandler(signal.SIGUSR1) as handler:
            assert not handler.signals_received(SINGLE)
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered before os.kill returns, to the main thread
            assert handler.signals_received(SINGLE)
            assert handler.signals_received(SINGLE), "the record persists until the loop acts on it"
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_default_signals_are_sigterm_and_sigint(sig):
    before = signal.getsignal(sig)
    with DistributedSignalHandler() as handler:
        os.kill(os.getpid(), sig)  # would end the test process (or raise KeyboardInterrupt) without the handler
        assert handler.signals_received(SINGLE)
    assert signal.getsignal(sig) is before


def _one_rank_signalled(rank, world_size):
    import torch.distributed as dist

    # Three pipeline stages: the signalled rank shares no group with rank 0, yet all stop together.
    parallel_state = initialize_model_parallel(1, 3)
    with DistributedSignalHandler() as handler:
        before = handler.signals_received(parallel_state)
        dist.barrier()
        if rank == world_size - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        after = handler.signals_received(parallel_state)
    return before, after


def test_every_rank_stops_when_one_is_signalled(run_distributed):
    assert run_distributed(_one_rank_signalled, world_size=3) == [(False, True)] * 3
