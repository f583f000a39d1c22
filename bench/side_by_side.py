"""Timing two implementations side by side: alternating rounds, ratios per round.

On a shared machine a run's absolute time says little: another job may take a core for a
second. Each round runs every contender once, one after another, so both see the same
machine state; the per-round ratio (peer time / our time, > 1 = we are faster) is the
number, reported as min / median / max over the rounds.

Each contender lives in a process of its own (``Contender``), started once and asked for one
timed call per round, so each runs as its users run it: with its own imports, its own
process-wide settings (megatron_lite's training keeps freed host memory for reuse,
``training/host_memory.py``; a transformers script does not) and its own warm caches. Only
one process works at a time; the other waits on its pipe. A distributed contender is a world
of such processes, one per rank, started as torchrun starts them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in each one's environment); each call runs on every rank at once.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass

from megatron_lite.process_groups.initialize import free_local_port


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


def _serve(connection, build, args, threads: int, environment: dict) -> None:
    """The contender's process: build once, then time one call of the built function per request."""
    os.environ.update(environment)
    import torch

    torch.set_num_threads(threads)
    call, info = build(*args)
    connection.send(info)
    while (request := connection.recv()) is not None:
        start, cpu_start = time.perf_counter(), time.process_time()
        result = call(*request)
        connection.send((Seconds(time.perf_counter() - start, time.process_time() - cpu_start), result))


def _rank_environment(rank: int, world_size: int, port: int) -> dict:
    """What torchrun puts in a rank's environment (none of it for a single process)."""
    if world_size == 1:
        return {}
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


class Contender:
    """``build(*args)`` run in a fresh process with ``threads`` intra-op threads; it returns (a callable,
    information for the parent). Calling the contender with some arguments runs the callable once there
    with them and returns (its ``Seconds``, what it returned).

    With ``world_size`` > 1, ``build`` runs on that many ranks at once (it initialises its own process
    group from the environment), ``info`` is the list of every rank's information, and a call returns
    (the slowest rank's wall clock with every rank's CPU time, the list of every rank's result)."""

    def __init__(self, build, *args, threads: int, world_size: int = 1):
        context = multiprocessing.get_context("spawn")  # nothing of the parent's state (or imports) carries over
        port = free_local_port() if world_size > 1 else 0
        self._connections, self._processes = [], []
        for rank in range(world_size):
            connection, child = context.Pipe()
            process = context.Process(target=_serve, daemon=True, args=(
                child, build, args, threads, _rank_environment(rank, world_size, port)))
            process.start()
            child.close()  # the worker's end: with it closed here, a worker that dies ends our reads
            self._connections.append(connection)
            self._processes.append(process)
        # Every rank is started before any is waited on: their builds meet in the process group's rendezvous.
        infos = [self._receive(rank) for rank in range(world_size)]
        self.info = infos[0] if world_size == 1 else infos

    def _receive(self, rank: int):
        try:
            return self._connections[rank].recv()
        except EOFError:
            raise RuntimeError(f"the benchmark's worker process (rank {rank}) stopped (exit code "
                               f"{self._processes[rank].exitcode}); its error is printed above.") from None

    def __call__(self, *args):
        for connection in self._connections:
            connection.send(args)
        replies = [self._receive(rank) for rank in range(len(self._connections))]
        if len(replies) == 1:
            return replies[0]
        seconds = Seconds(max(s.wall for s, _ in replies), sum(s.cpu for s, _ in replies))
        return seconds, [result for _, result in replies]

    def close(self) -> None:
        for connection, process in zip(self._connections, self._processes):
            if process.is_alive():
                connection.send(None)
        for process in self._processes:
            process.join(timeout=60)

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


def alternate_builds(build, variants: dict, rounds: int, *args) -> tuple[dict, dict]:
    """Each of ``variants`` (name -> the last argument of ``build``) in a one-thread Contender of
    ``build(*args, value)``, whose build already ran (and measured) a first step, then ``rounds`` alternating
    rounds: ({name: [Seconds of each round]}, {name: its build's info})."""
    with contextlib.ExitStack() as stack:
        contenders = {name: stack.enter_context(Contender(build, *args, value, threads=1))
                      for name, value in variants.items()}
        seconds, _ = alternate(contenders, rounds, warmup=0)
        return seconds, {name: contender.info for name, contender in contenders.items()}


def markdown_table(columns: list, rows: list) -> str:
    """A Markdown table of ``rows`` (each a list of cells, formatted already) under ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def load_average() -> str:
    """The 1-minute load average and the CPU count, which say how quiet the machine was."""
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
