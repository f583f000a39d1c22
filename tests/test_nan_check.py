"""A diverged run stops before it saves, and NaN intervals log nan (issue 22, items 3 and 4).

Found by a reliability pass: ``--bf16 --lr 1e6`` was NaN from iteration 2, ran all 30 iterations, exited 0
and saved a checkpoint with 164 of 213 tensors non-finite as the latest; its log said ``lm loss: 0.000000E+00``.
"""
import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)
from megatron_lite.pretrain_gpt import main as pretrain_main
from megatron_lite.process_groups.failures import FailedOnAnotherRank
from megatron_lite.training.nan_check import NonFiniteLossError
from megatron_lite.training.rerun_state_machine import ResultValidationError

DIVERGING = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
             "--vocab-size", "64", "--mock-data", "--micro-batch-size", "2", "--train-iters", "4", "--eval-interval",
             "100", "--eval-iters", "1", "--no-log-memory", "--log-interval", "1", "--bf16", "--lr", "1e6",
             "--lr-warmup-iters", "0"]


@pytest.mark.parametrize("rerun_mode", ["validate_results", "disabled"])
def test_a_nan_loss_stops_the_run_before_it_saves(tmp_path, capsys, rerun_mode):
    """Re-run first (the default): the NaN reproduces, so it is no transient fault; exit 17 as Megatron-LM's."""
    root = str(tmp_path / "ckpt")
    code = pretrain_main([*DIVERGING, "--save", root, "--save-interval", "1", "--rerun-mode", rerun_mode])
    assert code == (17 if rerun_mode == "validate_results" else 2)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training diverged" in errors[0] and "on rank 0" in errors[0], err
    if rerun_mode == "validate_results":
        assert "again when the iteration was re-run" in errors[0] and "the loss is nan" in errors[0], err
    iteration = int(errors[0].split("iteration ", 1)[1].split(":", 1)[0])
    assert 1 <= iteration <= 4 and storage.read_latest_iteration(root) in (None, iteration - 1)
    assert f" saved checkpoint at iteration {iteration:7d}" not in out


def test_without_the_check_nan_iterations_log_nan(tmp_path, capsys):
    assert pretrain_main([*DIVERGING, "--no-check-for-nan-in-loss-and-grad"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line and "lm loss" in line]
    assert len(lines) == 4 and "lm loss: nan |" in lines[-1] and "number of nan iterations:   1 |" in lines[-1]
    assert not any("lm loss: 0.000000E+00" in line for line in lines)


def _diverge_on_two_stages(rank, world_size, rerun_mode):
    from megatron_lite.training.loop import pretrain

    config = Config(model=ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64),
                    parallel=ParallelConfig(pipeline_model_parallel_size=2),
                    training=TrainingConfig(micro_batch_size=2, train_iters=4, bf16=True, rerun_mode=rerun_mode),
                    optimizer=OptimizerConfig(lr=1e6, clip_grad=0.0), data=DataConfig(mock_data=True),
                    checkpoint=CheckpointConfig(), logging=LoggingConfig(log_memory=False))
    try:
        pretrain(config, keep_process_group=True)
    except (NonFiniteLossError, ResultValidationError, FailedOnAnotherRank) as error:
        return type(error).__name__, str(error), getattr(error, "exit_code", 2)
    return None


@pytest.mark.parametrize("rerun_mode", ["disabled", "validate_results"])
def test_every_pipeline_stage_stops_when_the_last_one_sees_nan(run_distributed, rerun_mode):
    """Only the last stage has the loss, each stage its gradients: the lowest rank that saw a non-finite result
    reports it, the other stops too, with the same exit code."""
    (first, first_message, first_code), (last, last_message, last_code) = run_distributed(
        _diverge_on_two_stages, 2, args=(rerun_mode,))
    expected = "NonFiniteLossError" if rerun_mode == "disabled" else "ResultValidationError"
    assert sorted([first, last]) == sorted(["FailedOnAnotherRank", expected]) and first_code == last_code
    assert any(f"{what} is {value} on rank {rank}" in last_message + first_message
               for what in ("loss", "grad norm") for value in ("nan", "inf") for rank in (0, 1)), last_message


@pytest.mark.parametrize("flag", ["--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad"])
def test_the_flag_parses(flag):
    from megatron_lite.cli.arguments import parse_args

    config = parse_args([*DIVERGING, flag])
    assert config.training.check_for_nan_in_loss_and_grad == (flag == "--check-for-nan-in-loss-and-grad")
