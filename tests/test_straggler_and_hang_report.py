"""--log-straggler names the slow rank; a collective that times out names every rank's last collective
(issue 40). Two real gloo ranks train through ``pretrain``; rank 1 is made slow, then made to stall, by
slowing its own data reads (outside any collective, as a slow disk or data loader would)."""
import contextlib
import io
import json
import time

from megatron_lite.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)
from megatron_lite.process_groups import collectives, hang_report
from megatron_lite.training.straggler import format_straggler_report

TIMEOUT_MINUTES = 0.04  # 2.4 s
STALL_S = 5.0


def _config(train_iters, log_straggler=False):
    return Config(model=ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64),
                  parallel=ParallelConfig(distributed_timeout_minutes=TIMEOUT_MINUTES),
                  training=TrainingConfig(micro_batch_size=1, train_iters=train_iters, eval_interval=1000,
                                          eval_iters=1),
                  optimizer=OptimizerConfig(lr=1e-3), data=DataConfig(mock_data=True), checkpoint=CheckpointConfig(),
                  logging=LoggingConfig(log_interval=2, log_memory=False, log_straggler=log_straggler))


def _slow_then_stalled(rank, world_size):
    from megatron_lite.data.mock_dataset import MockGPTDataset
    from megatron_lite.training.loop import pretrain

    read = MockGPTDataset.__getitem__
    delays = iter([0.3, 0.3, 0.0, STALL_S] if rank == 1 else [])

    def slow_read(self, index):
        time.sleep(next(delays, 0.0))
        return read(self, index)

    MockGPTDataset.__getitem__ = slow_read
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        pretrain(_config(train_iters=2, log_straggler=True), keep_process_group=True)  # reads 1-2 (one per step)
    straggler_log = output.getvalue()
    try:
        pretrain(_config(train_iters=4), keep_process_group=True)  # its second read stalls
    except hang_report.CollectiveTimeoutError as error:
        return straggler_log, str(error)
    return straggler_log, None


def test_the_slow_rank_is_named_and_a_stall_names_every_ranks_last_collective(run_distributed):
    (_, first_error), (straggler_log, second_error) = run_distributed(_slow_then_stalled, 2)
    report = [line for line in straggler_log.splitlines() if "straggler report" in line]
    assert len(report) == 1 and "slowest rank 1" in report[0] and "fastest rank 0" in report[0], straggler_log

    # Rank 0 waited in the gradients' all-reduce of iteration 2 (the second run's), rank 1 never reached it.
    assert first_error is not None and first_error.startswith(
        f"rank 0 waited past --distributed-timeout-minutes ({TIMEOUT_MINUTES:g} minutes) in all_reduce #"), first_error
    waited = int(first_error.split("all_reduce #", 1)[1].split(" ", 1)[0])
    mine, theirs = first_error.split("; rank 1: ")
    assert f"rank 0: all_reduce #{waited} of group 'data'" in mine and "issued in iteration 2)" in mine
    assert mine.endswith("not returned"), mine
    assert "issued in iteration 1; the rank is in iteration 2)" in theirs and ", returned." in theirs, theirs
    assert "Rank 1 never reached it (fewer collectives of group 'data')" in theirs
    # Rank 1, once awake, finds rank 0 gone (or, while rank 0 tears down, waits in vain): its own error says so.
    assert second_error is not None and second_error.startswith(("rank 1 lost a peer", "rank 1 waited past"))


def test_a_published_entry_is_what_the_tracker_holds():
    """The thread writes the tracker's last collective when it changed, and only then."""
    class Store(dict):
        writes = 0

        def set(self, key, value):
            Store.writes += 1
            self[key] = value

    store = Store()
    publisher = hang_report.LastCollectivePublisher(store, rank=3, period_s=60)
    collectives.tracker.issue("broadcast", None)
    collectives.tracker.iteration = 7
    publisher.publish()
    publisher.publish()
    entry = json.loads(store[f"{hang_report.KEY_PREFIX}3"])
    assert Store.writes == 1 and (entry["op"], entry["group"], entry["now_in_iteration"], entry["returned"]) == \
        ("broadcast", "world", 7, False)
    collectives.tracker.iteration = None


def test_the_straggler_line():
    line = format_straggler_report(10, [[0.100, 0.020], [0.101, 0.090], [0.100, 0.030]])
    assert line == (" straggler report at iteration 10: step time 100.0-101.0 ms over 3 ranks | time outside "
                    "collectives: slowest rank 1 90.0 ms, fastest rank 0 20.0 ms, slowest/fastest 4.50")
