"""Megatron-LM's operational flags: --manual-gc, --empty-unused-memory-level, --profile,
--exit-duration-in-mins, --distributed-timeout-minutes and --log-throughput, each where Megatron acts."""
import datetime
import glob
import json
import os
import time
import types

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.cli.arguments import parse_args
from megatron_lite.training import operations
from tests.distributed import run_distributed

BASE = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1000", "--no-log-memory"]


def _pretrain(flags):
    from megatron_lite.training.loop import pretrain

    state, _, _ = pretrain(parse_args(BASE + flags))
    return state


class _FakeGC:
    def __init__(self):
        self.calls, self.enabled = [], True

    def isenabled(self):
        return self.enabled

    def disable(self):
        self.enabled = False
        self.calls.append("disable")

    def enable(self):
        self.enabled = True
        self.calls.append("enable")

    def collect(self, generation=2):
        self.calls.append(f"collect {generation}")


@pytest.mark.parametrize("eval_gc", [True, False])
def test_manual_gc_collects_at_iteration_boundaries(monkeypatch, eval_gc):
    fake = _FakeGC()
    monkeypatch.setattr(operations, "gc", fake)
    _pretrain(["--train-iters", "4", "--manual-gc", "--manual-gc-interval", "2"] + ([] if eval_gc else
                                                                                   ["--no-manual-gc-eval"]))
    # Start; iteration 2: evaluation (full collection before, youngest generation after), then the interval's
    # collection; the same at 4; automatic collection back on at the end.
    around_eval = ["collect 2", "collect 0"] if eval_gc else []
    assert fake.calls == ["disable", "collect 2", *around_eval, "collect 2", *around_eval, "collect 2", "enable"]


def test_without_manual_gc_nothing_is_touched(monkeypatch):
    fake = _FakeGC()
    monkeypatch.setattr(operations, "gc", fake)
    _pretrain(["--train-iters", "2"])
    assert fake.calls == []


@pytest.mark.parametrize("level, expected", [(0, 0), (1, 3 + 1), (2, 2 * 3 + 1)])
def test_empty_unused_memory_level(monkeypatch, level, expected):
    """Level 1: after each forward-backward and evaluation step; level 2: also after each optimizer step."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    _pretrain(["--train-iters", "3", "--empty-unused-memory-level", str(level)])
    assert len(calls) == expected


def test_profile_writes_a_trace_into_the_tensorboard_dir(tmp_path):
    _pretrain(["--train-iters", "4", "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
               "--tensorboard-dir", str(tmp_path)])
    traces = glob.glob(os.path.join(tmp_path, "rank0*.pt.trace.json"))
    assert len(traces) == 1
    with open(traces[0]) as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    # Iterations 1 and 2 are recorded (the schedule's steps), with the model's operators inside.
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#3" not in names
    assert any(name.startswith("aten::") for name in names)


def test_profile_only_on_profile_ranks(tmp_path):
    _pretrain(["--train-iters", "3", "--profile", "--profile-step-start", "1", "--profile-step-end", "2",
               "--profile-ranks", "1", "--tensorboard-dir", str(tmp_path)])
    assert not glob.glob(os.path.join(tmp_path, "*.pt.trace.json"))


def test_profile_needs_a_tensorboard_dir():
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match="--profile writes its trace into --tensorboard-dir"):
        parse_args(BASE + ["--profile"])


def _clock_running_ahead(minutes_per_call: float):
    """A stand-in for the time module whose clock gains ``minutes_per_call`` at every reading."""
    readings = []

    def fake_time():
        readings.append(None)
        return time.time() + 60.0 * minutes_per_call * len(readings)
    return types.SimpleNamespace(time=fake_time)


def test_exit_duration_saves_and_stops(tmp_path, monkeypatch):
    """The clock gains a minute per iteration: with --exit-duration-in-mins 2.5 the run saves and stops after 3."""
    monkeypatch.setattr(operations, "time", _clock_running_ahead(1.0))
    state = _pretrain(["--train-iters", "6", "--exit-duration-in-mins", "2.5", "--save", str(tmp_path)])
    assert state.iteration == 3
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def _run_with_fast_clock_on_rank_1(rank, world_size, save):
    if rank == 1:
        operations.time = _clock_running_ahead(1.0)
    state = _pretrain(["--train-iters", "6", "--global-batch-size", "4", "--exit-duration-in-mins", "2.5",
                       "--save", save])
    return state.iteration


def test_exit_duration_ranks_agree(tmp_path):
    """Only rank 1's clock runs ahead; the all-reduce MAX makes rank 0 stop on the same iteration."""
    assert run_distributed(_run_with_fast_clock_on_rank_1, 2, args=(str(tmp_path),)) == [3, 3]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_timeout_reaches_init_process_group(monkeypatch):
    from megatron_lite.process_groups import initialize

    seen = {}
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda backend, **kwargs: seen.update(kwargs))
    # No torchrun agent serves a store here: the attempt's store is not what this test is about.
    monkeypatch.setattr(initialize, "_torchrun_attempt_store", lambda env, environ, timeout: None)
    environ = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    initialize.initialize_distributed(ParallelConfig(distributed_timeout_minutes=7, distributed_backend="gloo"),
                                      environ=environ)
    assert seen["timeout"] == datetime.timedelta(minutes=7)


def _group_timeouts(rank, world_size):
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(2, 1, distributed_timeout_minutes=7)
    timeouts = {name: group._get_backend(torch.device("cpu")).options._timeout
                for name, group in state.groups.items() if group is not None}
    destroy_model_parallel(state)
    return timeouts


def test_every_new_group_gets_the_timeout():
    for timeouts in run_distributed(_group_timeouts, 2):
        assert set(timeouts) == {"tensor", "model"}
        assert set(timeouts.values()) == {datetime.timedelta(minutes=7)}


def test_log_throughput(capsys):
    _pretrain(["--train-iters", "1", "--log-interval", "1"])
    assert "throughput per GPU" not in capsys.readouterr().out  # as Megatron without the flag
    _pretrain(["--train-iters", "1", "--log-interval", "1", "--log-throughput"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration"))
    assert "| elapsed time per iteration (ms): " in line
    assert " | throughput per GPU (TFLOP/s/GPU): " in line and line.index("throughput") < line.index("learning rate")
