"""A pytest plugin: the CPU seconds each test costs, its ranks, torchrun and subprocesses included.

On a shared machine a test's wall time says more about the load than about the test; its CPU time does not.
For each test (setup, call and teardown) this records the CPU of pytest and of every process below it, read
from /proc (Linux): the live processes' own time and the time of the children they have reaped, so a rank
forked by the forkserver and gone counts through the forkserver. A run's first distributed test also pays the
forkserver's start (imports, seconds). Writes one line per test, "cpu_s pytest_cpu_s wall_s nodeid":

    python -m pytest -p tools.cpu_per_test tests            # into build/cpu_per_test.txt (CPU_PER_TEST_LOG)
    sort -rn build/cpu_per_test.txt | head -30
"""
from __future__ import annotations

import os
import time

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """CPU of ``root`` and its descendants: user + system of each, and of the children each has reaped."""
    parent_of, ticks = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:  # ended while we looked
            continue
        fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        parent_of[int(name)] = int(fields[1])
        ticks[int(name)] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    children: dict = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / _TICKS


class _Recorder:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.out = open(path, "a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        own = os.times()
        before = (_tree_cpu_s(os.getpid()), own.user + own.system, time.perf_counter())
        yield
        own = os.times()
        after = (_tree_cpu_s(os.getpid()), own.user + own.system, time.perf_counter())
        self.out.write(" ".join(f"{b - a:.2f}" for a, b in zip(before, after)) + f" {item.nodeid}\n")
        self.out.flush()

    def pytest_unconfigure(self, config):
        self.out.close()


def pytest_configure(config):
    config.pluginmanager.register(_Recorder(os.environ.get("CPU_PER_TEST_LOG", "build/cpu_per_test.txt")))
