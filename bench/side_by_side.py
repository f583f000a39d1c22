"""Timing two implementations side by side: alternating rounds, ratios per round.

On a shared machine a run's absolute time says little: another job may take a core for a
second. Each round runs every contender once, one after another, so both see the same
machine state; the per-round ratio (peer time / our time, > 1 = we are faster) is the
number, reported as min / median / max over the rounds.

Each contender lives in a process of its own (``Contender``), started once and asked for one
timed call per round, so each runs as its users run it: with its own imports, its own
process-wide settings (megatron_lite's training keeps freed host memory for reuse,
``training/host_memory.py``; a transformers script does not) and its own warm caches. Only
one process works at a time; the other waits on its pipe.
"""
from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Seconds:
    """One call's wall-clock time, and the CPU time its process spent (all threads): on a loaded machine
    the wall clock counts the time others held the cores, the CPU time mostly does not."""

    wall: float
    cpu: float


@dataclass(frozen=True)
class Ratio:
    """Per-round ratios of the peer's time to ours (> 1 = ours is faster)."""

    rounds: tuple

    @staticmethod
    def of(ours: list, peer: list, clock: str = "wall") -> "Ratio":
        """From two lists of ``Seconds``, by the wall clock or by CPU time."""
        return Ratio(tuple(getattr(p, clock) / getattr(o, clock) for o, p in zip(ours, peer)))

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    def __str__(self) -> str:
        return f"{min(self.rounds):.2f} / {self.median:.2f} / {max(self.rounds):.2f}"


def _serve(connection, build, args, threads: int) -> None:
    """The contender's process: build once, then time one call of the built function per request."""
    import torch

    torch.set_num_threads(threads)
    call, info = build(*args)
    connection.send(info)
    while (request := connection.recv()) is not None:
        start, cpu_start = time.perf_counter(), time.process_time()
        result = call(*request)
        connection.send((Seconds(time.perf_counter() - start, time.process_time() - cpu_start), result))


class Contender:
    """``build(*args)`` run in a fresh process with ``threads`` intra-op threads; it returns (a callable,
    information for the parent). Calling the contender with some arguments runs the callable once there
    with them and returns (its ``Seconds``, what it returned)."""

    def __init__(self, build, *args, threads: int):
        context = multiprocessing.get_context("spawn")  # nothing of the parent's state (or imports) carries over
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build, args, threads), daemon=True)
        self._process.start()
        child.close()  # the worker's end: with it closed here, a worker that dies ends our reads
        self.info = self._receive()

    def _receive(self):
        try:
            return self._connection.recv()
        except EOFError:
            raise RuntimeError(f"the benchmark's worker process stopped (exit code {self._process.exitcode}); "
                               "its error is printed above.") from None

    def __call__(self, *args):
        self._connection.send(args)
        return self._receive()

    def close(self) -> None:
        if self._process.is_alive():
            self._connection.send(None)
        self._process.join(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def alternate(runs: dict, rounds: int, *args, warmup: int = 1) -> tuple[dict, dict]:
    """({name: [Seconds of each round]}, {name: what its last call returned}) of calling each of ``runs``
    (name -> callable returning (Seconds, result), e.g. a Contender) with ``args`` once per round, in turn,
    after ``warmup`` untimed rounds (allocator, first-call dispatch, caches)."""
    for _ in range(warmup):
        for run in runs.values():
            run(*args)
    seconds, results = {name: [] for name in runs}, {}
    for _ in range(rounds):
        for name, run in runs.items():
            elapsed, results[name] = run(*args)
            seconds[name].append(elapsed)
    return seconds, results


def markdown_table(columns: list, rows: list) -> str:
    """A Markdown table of ``rows`` (each a list of cells, formatted already) under ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def load_average() -> str:
    """The 1-minute load average and the CPU count, which say how quiet the machine was."""
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
