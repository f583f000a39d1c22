"""Rank, world size, local rank, node and rendezvous address from each launcher's environment."""
import pytest
import torch.distributed as dist

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.process_groups.initialize import (LaunchEnv, expand_tasks_per_node, first_hostname,
                                                     initialize_distributed, resolve_launch_env)

TORCHRUN_NODE1_WORKER2 = {  # what torchrun sets for the third worker of the second node of 2 x 4
    "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "node001", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "42"}

SRUN_NODE1_TASK1 = {  # what srun sets for task 3 of --nodes=2 --ntasks-per-node=2
    "SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_STEP_NODELIST": "gpu[007-008]"}


def test_torchrun_environment():
    assert resolve_launch_env(TORCHRUN_NODE1_WORKER2) == LaunchEnv(
        rank=6, world_size=8, local_rank=2, local_world_size=4, master_addr="node001", master_port=29400,
        node_rank=1, launcher="torchrun")


def test_torchrun_without_local_variables_on_one_machine():
    env = resolve_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1234"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 2, 0)


def test_srun_one_task_per_gpu():
    # The step's tasks per node (2), not the job's (8); rendezvous on the first node, port from the job id.
    assert resolve_launch_env(SRUN_NODE1_TASK1) == LaunchEnv(
        rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="gpu007", master_port=20000 + 4242,
        node_rank=1, launcher="slurm")


def test_srun_every_task_of_a_layout():
    """All four tasks of 2 nodes x 2 agree on the rendezvous and cover ranks 0..3 once."""
    envs = []
    for procid in range(4):
        env = dict(SRUN_NODE1_TASK1, SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid % 2),
                   SLURM_NODEID=str(procid // 2))
        envs.append(resolve_launch_env(env))
    assert [e.rank for e in envs] == [0, 1, 2, 3]
    assert [(e.node_rank, e.local_rank) for e in envs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(e.master_addr, e.master_port, e.world_size) for e in envs} == {("gpu007", 24242, 4)}


def test_srun_uneven_tasks_per_node_and_exported_master():
    env = dict(SRUN_NODE1_TASK1, SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NTASKS="5",
               SLURM_STEP_TASKS_PER_NODE="4,1", MASTER_ADDR="10.0.0.7", MASTER_PORT="23456")
    got = resolve_launch_env(env)
    assert (got.local_world_size, got.master_addr, got.master_port) == (1, "10.0.0.7", 23456)


def test_torchrun_under_srun_wins():
    """One torchrun per node under srun: SLURM's variables describe the torchrun task, not the worker."""
    srun_torchrun_task = dict(SRUN_NODE1_TASK1, SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NTASKS="2",
                              SLURM_STEP_TASKS_PER_NODE="1(x2)")
    env = resolve_launch_env({**srun_torchrun_task, **TORCHRUN_NODE1_WORKER2})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.master_addr) == (
        "torchrun", 6, 8, 2, "node001")


def test_one_count_for_every_node():
    env = {k: v for k, v in SRUN_NODE1_TASK1.items() if "TASKS_PER_NODE" not in k}
    assert resolve_launch_env(dict(env, SLURM_NTASKS_PER_NODE="2")).local_world_size == 2


def test_no_launcher_is_one_process():
    assert resolve_launch_env({}) == LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                               master_addr="127.0.0.1", master_port=29500, node_rank=0)


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "LOCAL_RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "rank 4 is outside world size 4"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' must be an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
     "MASTER_PORT 70000 is not a TCP port"),
    ({k: v for k, v in SRUN_NODE1_TASK1.items() if "NODELIST" not in k}, "export MASTER_ADDR"),
    (dict(SRUN_NODE1_TASK1, SLURM_LOCALID="2"), "local rank 2 is outside the 2 processes"),
    (dict(SRUN_NODE1_TASK1, SLURM_STEP_TASKS_PER_NODE="two"), "SLURM_STEP_TASKS_PER_NODE='two'"),
    (dict(SRUN_NODE1_TASK1, SLURM_NODEID="2"), "lists 2 nodes, but SLURM_NODEID is 2"),
])
def test_bad_environment_names_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        resolve_launch_env(environ)


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("gpu[007-010,12],cpu1", "gpu007"), ("a-[3,5-6]", "a-3"),
    ("rack[2-3]-n[01-04]", "rack2-n01"), ("x1,y[1-2]", "x1"), ("127.0.0.[1-2]", "127.0.0.1")])
def test_first_hostname(nodelist, first):
    assert first_hostname(nodelist) == first


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE='2x3'"):
        expand_tasks_per_node("2x3")


def test_initialize_distributed_single_process_starts_no_group():
    env = initialize_distributed(ParallelConfig(), environ={})
    assert env.world_size == 1 and not dist.is_initialized()


def _keeps_existing_group(rank, world_size):
    import os

    env = initialize_distributed(ParallelConfig(), environ=dict(os.environ))
    return env.rank, env.world_size, dist.get_rank()


def test_initialize_distributed_keeps_an_existing_group(run_distributed):
    assert run_distributed(_keeps_existing_group, world_size=2) == [(0, 2, 0), (1, 2, 1)]


def _joins_from_slurm_variables(rank, world_size):
    """Build a fresh world from srun-style variables only (the harness's group is torn down first)."""
    from megatron_lite.process_groups.initialize import free_local_port

    # Rank 0 picks the port while the harness's group can still share it, so no other
    # process can take it between the pick and the bind on every rank.
    port = [free_local_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    port = port[0]
    dist.destroy_process_group()
    environ = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_NTASKS": str(world_size), "SLURM_STEP_TASKS_PER_NODE": str(world_size),
               "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
    env = initialize_distributed(ParallelConfig(distributed_backend="gloo"), environ=environ)
    return env.launcher, dist.get_rank(), dist.get_world_size(), dist.get_backend()


def test_initialize_distributed_from_slurm_variables(run_distributed):
    results = run_distributed(_joins_from_slurm_variables, world_size=2)
    assert results == [("slurm", 0, 2, "gloo"), ("slurm", 1, 2, "gloo")]
