"""Who am I, and who else is there: the launcher's environment, read once.

Two launchers start megatron_lite. ``torchrun`` starts every process itself and
sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``.
SLURM's ``srun`` with one task per GPU sets ``SLURM_PROCID``/``SLURM_NTASKS``/
``SLURM_LOCALID``/``SLURM_NODEID`` and the job's node list instead. When
``torchrun`` itself runs under ``srun`` (one ``torchrun`` per node) both sets are
present and torchrun's win: the SLURM ones then describe the ``torchrun`` task,
not the training process.

``resolve_launch_env`` is pure (it takes the environment as a mapping) so the
derivation is tested without launching anything; ``initialize_distributed``
acts on it.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist
# Imported before any process group exists, not at the first optimizer step (torch._dynamo imports it then):
# its functions take ``group=group.WORLD`` as a default argument, so imported once the WORLD group exists it
# would hold that group past its teardown, and gloo's threads with it, into interpreter shutdown.
import torch.distributed.nn  # noqa: F401

from megatron_lite.config import ConfigError, ParallelConfig

# torchrun's own default rendezvous port, used when nothing else names one.
DEFAULT_MASTER_PORT = 29500


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a one-machine process group (tests, benches,
    the planner's calibration): the OS picks it, so concurrent jobs on one machine do not collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int
    launcher: str = "none"  # "torchrun", "slurm" or "none" (a plain single process)


def resolve_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Derive rank, world size, local rank, node and rendezvous address from the environment.

    Args:
        environ: the process environment (a mapping, so tests pass a dict).

    Returns:
        The ``LaunchEnv``: torchrun's variables if ``RANK`` is set, else SLURM's if
        ``SLURM_PROCID`` is set, else a single process.

    Raises:
        ConfigError: a variable is missing, not an integer, or inconsistent.
    """
    if "RANK" in environ:
        env = _from_torchrun(environ)
    elif "SLURM_PROCID" in environ:
        env = _from_slurm(environ)
    else:
        env = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                        master_port=_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT), node_rank=0)
    _check(env)
    return env


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", world_size)
    rank = _int(environ, "RANK")
    # A hand-set RANK/WORLD_SIZE on one machine may omit the local variables;
    # torchrun always sets them, and across nodes they cannot be guessed.
    local_rank = _int(environ, "LOCAL_RANK", rank if local_world_size == world_size else None)
    # torchrun calls the node's index GROUP_RANK (one worker group per node).
    node_rank = _int(environ, "GROUP_RANK", rank // local_world_size)
    return LaunchEnv(rank=rank, world_size=world_size, local_rank=local_rank,
                     local_world_size=local_world_size,
                     master_addr=_str(environ, "MASTER_ADDR", "127.0.0.1" if world_size == 1 else None),
                     master_port=_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT if world_size == 1 else None),
                     node_rank=node_rank, launcher="torchrun")


def _from_slurm(environ: Mapping[str, str]) -> LaunchEnv:
    rank = _int(environ, "SLURM_PROCID")
    # SLURM_NPROCS is the older spelling of SLURM_NTASKS.
    world_size = _int(environ, "SLURM_NPROCS" if "SLURM_NTASKS" not in environ and "SLURM_NPROCS" in environ
                      else "SLURM_NTASKS")
    node_rank = _int(environ, "SLURM_NODEID", 0)
    local_rank = _int(environ, "SLURM_LOCALID")
    # The step's own task layout comes first: an srun inside a job may use fewer tasks than the job.
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if name in environ:
            per_node = expand_tasks_per_node(environ[name], name)
            if len(per_node) == 1:  # one count for every node (SLURM_NTASKS_PER_NODE's form)
                per_node = per_node * (node_rank + 1)
            if node_rank >= len(per_node):
                raise ConfigError(f"{name}={environ[name]!r} lists {len(per_node)} nodes, but SLURM_NODEID is "
                                  f"{node_rank}.")
            local_world_size = per_node[node_rank]
            break
    else:
        local_world_size = world_size
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        nodelist = next((environ[n] for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if environ.get(n)), None)
        if nodelist is None:
            raise ConfigError("SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: export MASTER_ADDR "
                              "(the first node, from `scontrol show hostnames`) before srun.")
        master_addr = first_hostname(nodelist)
    if "MASTER_PORT" in environ:
        master_port = _int(environ, "MASTER_PORT")
    else:
        # Derived from the job id so two jobs sharing a node do not collide; kept
        # below Linux's ephemeral range (32768+), where the kernel hands out client ports.
        master_port = 20000 + _int(environ, "SLURM_JOB_ID", 0) % 10000
    return LaunchEnv(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                     master_addr=master_addr, master_port=master_port, node_rank=node_rank, launcher="slurm")


def expand_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """SLURM's compressed per-node task counts, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ConfigError(f"{name}={value!r} is not SLURM's per-node task list (like '2(x3),1').")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_hostname(nodelist: str) -> str:
    """The first host of a SLURM node list, as ``scontrol show hostnames | head -n1`` gives it.

    ``"gpu[007-010,12],cpu1"`` -> ``"gpu007"``: each bracket's first entry, zero padding kept.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first comma outside brackets ends the first item
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())
    if not first or "[" in first or "]" in first:
        raise ConfigError(f"cannot read the first host of the SLURM node list {nodelist!r}; "
                          "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1).")
    return first


_MISSING = object()


def _missing(name: str) -> ConfigError:
    return ConfigError(f"{name} is not set, but the launcher's other variables are. Start the job with "
                       f"torchrun or srun (launch_scripts/), or export {name} yourself.")


def _str(environ: Mapping[str, str], name: str, default=_MISSING) -> str:
    """``environ[name]``; ``default`` when unset, unless it is missing or None (then an error)."""
    value = environ.get(name)
    if value:
        return value
    if default is _MISSING or default is None:
        raise _missing(name)
    return default


def _int(environ: Mapping[str, str], name: str, default=_MISSING) -> int:
    """``int(environ[name])``; ``default`` when unset, unless it is missing or None (then an error)."""
    value = environ.get(name)
    if value is None or value == "":
        if default is _MISSING or default is None:
            raise _missing(name)
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer.") from None


def _check(env: LaunchEnv) -> None:
    source = {"torchrun": "RANK/WORLD_SIZE/LOCAL_RANK", "slurm": "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID",
              "none": "the environment"}[env.launcher]
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ConfigError(f"rank {env.rank} is outside world size {env.world_size} (from {source}).")
    if env.local_world_size < 1 or not 0 <= env.local_rank < env.local_world_size:
        raise ConfigError(f"local rank {env.local_rank} is outside the {env.local_world_size} processes "
                          f"on this node (from {source}).")
    if not 0 < env.master_port < 65536:
        raise ConfigError(f"MASTER_PORT {env.master_port} is not a TCP port (1-65535).")


def initialize_distributed(parallel_config: ParallelConfig,
                           environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Join the job's default process group and pick this process's GPU.

    The backend is ``parallel_config.distributed_backend`` if set, else NCCL when
    CUDA is available and gloo otherwise; a collective that waits longer than
    ``--distributed-timeout-minutes`` fails. A world of one process starts no group
    (every group is then ``None`` and collectives are no-ops). A group someone
    already initialised (a test harness, a notebook) is kept, after checking it
    agrees with the environment.

    Returns:
        The ``LaunchEnv`` the process group was built from.
    """
    env = resolve_launch_env(os.environ if environ is None else environ)
    backend = parallel_config.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA, and no GPU is visible; use gloo on CPU.")
    if torch.cuda.is_available():
        torch.cuda.set_device(_cuda_device(env))
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise ConfigError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                              f"{dist.get_world_size()}, but the launcher says rank {env.rank} of {env.world_size}.")
        return env
    if env.world_size == 1:
        return env
    timeout = datetime.timedelta(minutes=parallel_config.distributed_timeout_minutes)
    if env.launcher == "torchrun":
        store = _torchrun_attempt_store(env, os.environ if environ is None else environ, timeout)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return env
    # Under srun nobody serves a store yet: rank 0 hosts it at MASTER_ADDR:MASTER_PORT.
    dist.init_process_group(backend, init_method=f"tcp://{_url_host(env.master_addr)}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env


def _torchrun_attempt_store(env: LaunchEnv, environ: Mapping[str, str], timeout: datetime.timedelta):
    """The rendezvous store of this attempt of a torchrun job.

    torchrun's agent serves the store on MASTER_PORT (the workers join it rather than bind the port again) and
    keeps serving it across in-job restarts (``--max-restarts``): the keys the previous attempt's ranks wrote,
    their gloo addresses among them, are still there, and a restarted rank would connect to a dead one. So each
    attempt's keys live under their own prefix (``TORCHELASTIC_RESTART_COUNT``)."""
    agent_serves = environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "True"
    store = dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size,
                          is_master=not agent_serves and env.rank == 0, timeout=timeout,
                          multi_tenant=not agent_serves)
    return dist.PrefixStore(f"megatron_lite/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _cuda_device(env: LaunchEnv) -> int:
    count = torch.cuda.device_count()
    if count == 1:
        return 0  # the cluster bound one GPU to this task (e.g. srun --gpu-bind): it is device 0
    if env.local_rank >= count:
        raise ConfigError(f"local rank {env.local_rank} but only {count} GPUs are visible on this node: launch "
                          f"at most {count} processes per node (--nproc-per-node / --ntasks-per-node).")
    return env.local_rank


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in a URL
