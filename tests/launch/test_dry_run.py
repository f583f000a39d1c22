"""--dry-run prints the launch command and the rank map, starts nothing, and rejects bad layouts."""
import shlex

from tests.launch.helpers import parse_rank_map, run_script, script_env, slurm_job_env
from tools.print_rank_map import layout_warnings, rank_map


def expected_row(rank, *, nproc_per_node, tp, dp, cp=1):
    """Megatron's order written out independently: tensor fastest, then context, then data, then pipeline; nodes
    in blocks. (node, local_rank, tp, pp, dp, cp)"""
    return (rank // nproc_per_node, rank % nproc_per_node, rank % tp, rank // (tp * cp * dp), (rank // (tp * cp)) % dp,
            (rank // tp) % cp)


def test_slurm_dry_run_multi_node_rank_map(tmp_path):
    env = slurm_job_env(tmp_path / "slurm", nodes=2, tasks_per_node=4, CONFIG="tiny",
                        TENSOR_MODEL_PARALLEL_SIZE=2, PIPELINE_MODEL_PARALLEL_SIZE=2)
    result = run_script("pretrain_gpt_slurm.sh", env, "--dry-run")
    assert result.returncode == 0, result.stderr
    rows = parse_rank_map(result.stdout)
    assert [r[0] for r in rows] == list(range(8))
    for rank, host, *coords in rows:
        assert tuple(coords) == expected_row(rank, nproc_per_node=4, tp=2, dp=2)[1:]
        assert host == f"127.0.0.{rank // 4 + 1}"  # the node names come from scontrol show hostnames
    assert rows[5] == (5, "127.0.0.2", 1, 1, 1, 0, 0)  # rank 5: second node, tp 1, pp 1, dp 0, cp 0
    assert "tensor-parallel 2 x pipeline-parallel 2 x data-parallel 2" in result.stdout

    command = next(line for line in result.stdout.splitlines() if line.startswith("[megatron_lite] command: "))
    argv = shlex.split(command.split(": ", 1)[1])
    assert argv[:5] == ["srun", "--nodes=2", "--kill-on-bad-exit=1", "--ntasks-per-node=4", "--ntasks=8"]
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == "2"
    assert "--exit-signal-handler" in argv and "--mock-data" in argv
    assert not (tmp_path / "slurm" / "srun_pids").exists(), "a dry run must not start srun"


def test_slurm_dry_run_torchrun_mode_and_extra_flags(tmp_path):
    env = slurm_job_env(tmp_path / "slurm", nodes=2, tasks_per_node=2, CONFIG="tiny", LAUNCH_MODE="torchrun",
                        MASTER_PORT=23456)
    result = run_script("pretrain_gpt_slurm.sh", env, "--dry-run", "--", "--tensor-model-parallel-size", "4")
    assert result.returncode == 0, result.stderr
    command = next(line for line in result.stdout.splitlines() if "command: " in line).split(": ", 1)[1]
    argv = shlex.split(command)
    assert argv[:5] == ["srun", "--nodes=2", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--ntasks=2"]
    assert argv[5:7] == ["bash", "-c"] and '--node-rank="$SLURM_NODEID"' in argv[7]
    assert "--master-addr=127.0.0.1" in argv and "--master-port=23456" in argv and "--nproc-per-node=2" in argv
    # Flags after -- come last and win, and the rank map follows them.
    assert argv[-2:] == ["--tensor-model-parallel-size", "4"]
    assert [r[3] for r in parse_rank_map(result.stdout)] == [0, 1, 2, 3]
    assert "cross node boundaries" in result.stdout


def test_torchrun_dry_run_second_node_resuming(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    env = script_env(tmp_path, CONFIG="tiny", NNODES=2, NODE_RANK=1, NPROC_PER_NODE=2, MASTER_ADDR="node0",
                     PIPELINE_MODEL_PARALLEL_SIZE=2, SAVE=tmp_path / "ckpt")
    result = run_script("pretrain_gpt_torchrun.sh", env, "--dry-run")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(next(line for line in result.stdout.splitlines() if "command: " in line).split(": ", 1)[1])
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    launcher = argv[:argv.index("megatron_lite.pretrain_gpt")]
    assert shlex.join(launcher).endswith("--nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr node0 "
                                         "--master-port 29500 -m")
    # A checkpoint in SAVE means a restarted job: resume from it.
    assert f"resuming from {tmp_path / 'ckpt'} (iteration 7)" in result.stdout
    assert argv[argv.index("--save") + 1] == argv[argv.index("--load") + 1] == str(tmp_path / "ckpt")
    assert parse_rank_map(result.stdout) == [(r, f"node{r // 2}", *expected_row(r, nproc_per_node=2, tp=1, dp=2)[1:])
                                             for r in range(4)]


def test_bad_layout_fails_before_launch(tmp_path):
    env = slurm_job_env(tmp_path / "slurm", nodes=2, tasks_per_node=3, CONFIG="tiny", TENSOR_MODEL_PARALLEL_SIZE=4)
    result = run_script("pretrain_gpt_slurm.sh", env, "--dry-run")
    assert result.returncode == 2
    assert "world size 6 is not" in result.stderr and "--tensor-model-parallel-size" in result.stderr


def test_unknown_config_and_mode_are_named(tmp_path):
    result = run_script("pretrain_gpt_torchrun.sh", script_env(tmp_path, CONFIG="gpt5"), "--dry-run")
    assert result.returncode == 2 and "CONFIG=gpt5" in result.stderr and "gpt2_125m" in result.stderr
    assert "WARNING" not in result.stderr, result.stderr  # one error, not also a warning that gpt5 is sized for GPUs
    env = slurm_job_env(tmp_path / "slurm", nodes=1, tasks_per_node=1, LAUNCH_MODE="mpirun")
    result = run_script("pretrain_gpt_slurm.sh", env, "--dry-run")
    assert result.returncode == 2 and "LAUNCH_MODE=mpirun" in result.stderr


def test_slurm_script_refuses_to_run_outside_a_job(tmp_path):
    result = run_script("pretrain_gpt_slurm.sh", script_env(tmp_path, CONFIG="tiny"))
    assert result.returncode == 2 and "not inside a SLURM job" in result.stderr


def test_rank_map_shows_context_parallel_ranks(capsys):
    """tp2 x cp2 x pp2 x dp2: the printed table is the rule written out, and the header names every size."""
    from tools.print_rank_map import main
    assert main(["--nnodes", "2", "--nproc-per-node", "8", "--", "--num-layers", "2", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "256", "--mock-data",
                 "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--context-parallel-size", "2", "--attention-dropout", "0"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel 2 x pipeline-parallel 2 x data-parallel 2 x context-parallel 2" in out
    assert parse_rank_map(out) == [(r, f"node{r // 8}", *expected_row(r, nproc_per_node=8, tp=2, dp=2, cp=2)[1:])
                                   for r in range(16)]


def test_rank_map_keeps_tensor_parallel_groups_inside_nodes():
    rows = rank_map(nnodes=4, nproc_per_node=8, tensor_model_parallel_size=8, pipeline_model_parallel_size=2)
    for rank in range(0, 32, 8):
        assert {row["node"] for row in rows[rank:rank + 8]} == {rank // 8}
        assert [row["tp"] for row in rows[rank:rank + 8]] == list(range(8))
    assert layout_warnings(8, 8) == []
    assert layout_warnings(8, 16) and layout_warnings(6, 4)


def test_torchrun_dry_run_warns_about_mock_data_no_save_and_a_gpu_config_on_cpu(tmp_path):
    result = run_script("pretrain_gpt_torchrun.sh", script_env(tmp_path, CONFIG="llama_7b", NPROC_PER_NODE=8),
                        "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "WARNING: DATA_PATH is unset: training on --mock-data (random tokens, the loss stays flat)" in result.stderr
    assert "WARNING: SAVE is unset: no checkpoint will be written" in result.stderr
    assert "WARNING: CONFIG=llama_7b is sized for GPUs and none is visible" in result.stderr


def test_torchrun_default_config_fits_a_machine_without_gpus(tmp_path):
    result = run_script("pretrain_gpt_torchrun.sh", script_env(tmp_path, SAVE=str(tmp_path / "ckpt"),
                                                               DATA_PATH=str(tmp_path / "corpus")),
                        "--dry-run", "--", "--vocab-size", "256")
    assert result.returncode == 0, result.stderr
    assert "CONFIG unset: tiny fits this machine (0 GPU(s) visible)" in result.stdout
    assert "WARNING" not in result.stderr
