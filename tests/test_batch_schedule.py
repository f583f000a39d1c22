"""Samples-based runs and batch-size ramp-up, against Megatron-LM's formulas.

--train-samples gives the run's length in samples (iterations derived as Megatron's
update_train_iters does), the LR schedule counts samples, and --rampup-batch-size grows the
global batch as Megatron's RampupBatchsizeNumMicroBatchesCalculator: the loop, the data position,
consumed samples, checkpoints and the log line follow it.
"""
import math
import os
import re

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.config import ConfigError
from megatron_lite.config.arguments import parse_args
from megatron_lite.training.num_microbatches_calculator import NumMicroBatchesCalculator
from tests.distributed import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--no-log-memory"]


def megatron_rampup_batch(consumed: int, global_batch: int, start: int, increment: int, rampup_samples: int) -> int:
    """RampupBatchsizeNumMicroBatchesCalculator.update, restated from Megatron-LM."""
    per_increment = rampup_samples / ((global_batch - start) // increment)
    if consumed > rampup_samples:
        return global_batch
    return start + int(consumed / per_increment) * increment


def megatron_lr(num_steps, *, max_lr, min_lr, warmup, decay, style="cosine"):
    """OptimizerParamScheduler.get_lr, restated from Megatron-LM (init_lr 0)."""
    if warmup > 0 and num_steps <= warmup:
        return max_lr * num_steps / warmup
    if num_steps > decay:
        return min_lr
    ratio = (num_steps - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def test_ramp_up_matches_megatrons_own_test():
    """Megatron-LM's test_ramp_up: rampup (16, 16, 96), global batch 32, micro batch 8, dp 2."""
    calculator = NumMicroBatchesCalculator(global_batch_size=32, micro_batch_size=8, data_parallel_size=2,
                                           rampup_batch_size=[16, 16, 96])
    consumed, seen = 0, [0]
    while consumed < 256:
        assert calculator.get_num_microbatches(consumed) == calculator.get_current_global_batch_size(consumed) // 16
        consumed += calculator.get_current_global_batch_size(consumed)
        seen.append(consumed)
    assert seen == [0, 16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]


@pytest.mark.parametrize("global_batch, rampup", [(1024, [16, 8, 300000]), (12, [4, 4, 16]), (1536, [16, 16, 5859375])])
def test_global_batch_follows_megatrons_formula(global_batch, rampup):
    calculator = NumMicroBatchesCalculator(global_batch_size=global_batch, micro_batch_size=2, data_parallel_size=2,
                                           rampup_batch_size=rampup)
    for consumed in sorted({0, 1, rampup[2] // 7, rampup[2] // 3, rampup[2] // 2, rampup[2] - 1, rampup[2],
                            rampup[2] + 1, 10 * rampup[2]}):
        assert calculator.get_current_global_batch_size(consumed) == megatron_rampup_batch(consumed, global_batch,
                                                                                           *rampup)


def test_train_iters_from_samples_as_megatron():
    """Ramp-up (12, rampup 4 4 16): batches 4, 4, 8, 12 while consumed <= 16, then whole batches of 12."""
    calculator = NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=1,
                                           rampup_batch_size=[4, 4, 16])
    assert calculator.iterations_for(64) == 4 + (64 - 28) // 12 == 7
    assert calculator.consumed_samples_after(7) == 64 and calculator.consumed_samples_after(3) == 16
    constant = NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=1)
    assert constant.iterations_for(100) == 8  # a partial last batch is dropped, as Megatron


@pytest.mark.parametrize("extra, match", [
    (["--train-iters", "5", "--train-samples", "40"], "--train-iters and --train-samples are mutually exclusive"),
    (["--train-iters", "5", "--lr-decay-samples", "40"], "--lr-decay-samples counts samples.*use --lr-decay-iters"),
    (["--train-iters", "5", "--lr-warmup-samples", "4"], "--lr-warmup-samples counts samples.*--lr-warmup-iters"),
    (["--train-samples", "40", "--lr-decay-iters", "5"], "--lr-decay-iters counts iters.*use --lr-decay-samples"),
    (["--train-samples", "40", "--lr-warmup-iters", "1"], "--lr-warmup-iters counts iters.*--lr-warmup-samples"),
    (["--train-iters", "5", "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction and --lr-warmup-iters both set the warmup"),
    (["--train-samples", "40", "--lr-warmup-samples", "4", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction and --lr-warmup-samples both set the warmup"),
    (["--train-samples", "40", "--lr-warmup-samples", "40"], r"--lr-warmup-samples \(40\) must be smaller than "
                                                             r"--lr-decay-samples \(40"),
    (["--train-samples", "40", "--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in"),
    (["--rampup-batch-size", "4", "4"], "--rampup-batch-size: expected 3 arguments"),
])
def test_iterations_and_samples_do_not_mix(extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(BASE + extra)


@pytest.mark.parametrize("rampup, match", [
    ([4, 3, 16], r"minus START \(4\) must be a non-negative multiple of INCREMENT \(3\)"),
    ([16, 4, 16], "must be a non-negative multiple"),
    ([2, 2, 16], r"--rampup-batch-size START \(2\) must be divisible by --micro-batch-size \(2\) x data-parallel size "
               r"\(2\) = 4"),
    ([4, 4, 0], "must all be positive"),
])
def test_bad_ramp_ups_name_the_flag(rampup, match):
    with pytest.raises(ConfigError, match=match):
        NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=2,
                                  rampup_batch_size=rampup)


def _log_lines(text: str) -> list[dict]:
    """consumed samples, learning rate and global batch size of every iteration line."""
    pattern = (r"iteration +(\d+)/ *(\d+) \| consumed samples: +(\d+) \|.*learning rate: ([0-9.E+-]+) \| "
               r"global batch size: +(\d+) \| lm loss: ([0-9.E+-]+)")
    return [dict(iteration=int(m[0]), train_iters=int(m[1]), consumed=int(m[2]), lr=float(m[3]), batch=int(m[4]),
                 loss=float(m[5])) for m in re.findall(pattern, text)]


SAMPLES_RUN = ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--train-samples", "64",
               "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-samples", "8", "--lr-decay-style", "cosine"]


def test_samples_run_with_ramp_up(tmp_path, capsys):
    """Batches 4, 4, 8, 12, 12, 12, 12 (7 iterations, 64 samples); the LR follows Megatron's schedule in
    samples; a checkpoint is written whenever the micro-batch count grows, and at the end."""
    from megatron_lite.training.loop import pretrain

    state, _, _ = pretrain(parse_args(BASE + SAMPLES_RUN + ["--save", str(tmp_path)]))
    out = capsys.readouterr().out
    assert "192 tokens per iteration (ramped up from 4 by 4 over 16 samples), 7 iterations" in out  # start-up
    lines = _log_lines(out)
    assert [line["batch"] for line in lines] == [4, 4, 8, 12, 12, 12, 12]
    assert [line["consumed"] for line in lines] == [4, 8, 16, 28, 40, 52, 64]
    assert {line["train_iters"] for line in lines} == {7}
    assert state.iteration == 7 and state.consumed_train_samples == 64
    for line in lines:  # logged after the step: the LR at the samples consumed so far
        expected = megatron_lr(line["consumed"], max_lr=1e-3, min_lr=1e-4, warmup=8, decay=64)
        assert line["lr"] == pytest.approx(expected, rel=1e-6), line
    # Micro-batches per iteration go 2, 2, 4, 6: the checkpoints after iterations 2 and 3 let a resume pick a
    # data-parallel size for the new batch.
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000007",
                                            "latest_checkpointed_iteration.txt"]


def test_ramp_up_resumes_mid_ramp(tmp_path, capsys):
    """Resumed at iteration 2 (batch 4 -> 8 next), the run continues with the uninterrupted run's
    batches, data and losses."""
    from megatron_lite.training.loop import pretrain

    flags = BASE + SAMPLES_RUN + ["--save", str(tmp_path)]
    pretrain(parse_args(flags))
    uninterrupted = _log_lines(capsys.readouterr().out)
    storage.write_latest_iteration(str(tmp_path), 2)
    state, _, _ = pretrain(parse_args(flags + ["--load", str(tmp_path)]))
    resumed = _log_lines(capsys.readouterr().out)
    assert state.consumed_train_samples == 64
    assert resumed == uninterrupted[2:]


def test_iteration_warmup_fraction_counts_samples():
    """--lr-warmup-fraction with --train-iters: Megatron's schedule is in samples, decay = iters x batch."""
    from megatron_lite.optimizer.optimizer_param_scheduler import get_optimizer_param_scheduler

    class Optimizer:
        param_groups = [{}]

    config = parse_args(BASE + ["--global-batch-size", "8", "--train-iters", "100", "--lr-decay-iters", "80",
                                "--lr-warmup-fraction", "0.05", "--lr", "1.0", "--min-lr", "0.1"])
    scheduler = get_optimizer_param_scheduler(Optimizer(), config, global_batch_size=8)
    assert (scheduler.lr_warmup_steps, scheduler.lr_decay_steps) == (0.05 * 640, 640)
    for samples in [8, 16, 32, 40, 320, 640, 648]:
        scheduler.num_steps = 0
        scheduler.step(increment=samples)
        assert scheduler.get_lr() == pytest.approx(megatron_lr(samples, max_lr=1.0, min_lr=0.1, warmup=32,
                                                               decay=640))


def _train_losses(rank, world_size, flags):
    from megatron_lite.training.loop import pretrain

    state, _, _ = pretrain(parse_args(flags), keep_process_group=True)
    return state.losses, state.consumed_train_samples


def test_ramp_up_under_data_parallelism_matches_one_process():
    """dp=2 takes 1, 1, 2, 3, ... micro-batches where one process takes 2, 2, 4, 6: same samples, same losses."""
    flags = BASE + SAMPLES_RUN
    (reference,) = run_distributed(_train_losses, 1, args=(flags,))
    per_rank = run_distributed(_train_losses, 2, args=(flags,))
    for losses, consumed in per_rank:
        assert consumed == 64 and len(losses) == 7
        assert losses == pytest.approx(reference[0], rel=1e-5)


def test_microbatch_counts_of_a_ramp():
    calculator = NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=1,
                                           rampup_batch_size=[4, 4, 16])
    assert calculator.microbatch_counts() == [2, 4, 6]


def _no_training(*args, **kwargs):
    raise AssertionError("training started: the start-up check let the ramp-up through")


def _start_interleaved_with_ramp_up(rank, world_size):
    from megatron_lite.training import loop

    loop.train = _no_training
    flags = BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8",
                    "--rampup-batch-size", "4", "2", "16", "--train-samples", "64"]
    try:
        _train_losses(rank, world_size, flags)
    except ConfigError as error:
        return str(error)
    return None


def test_interleaving_checks_every_ramp_up_batch_at_start_up():
    """Micro-batch counts 2, 3, 4: the interleaved schedule needs multiples of the 2 stages, which the
    start-up check says before the first step, not at the ramp-up's first odd batch."""
    for error in run_distributed(_start_interleaved_with_ramp_up, 2):
        assert error is not None and "multiple of --pipeline-model-parallel-size (2)" in error


def _fine_tuning_run(tmp_path) -> list[str]:
    """The samples run on chat data (--sft: train, validation and test iterators, per-token loss)."""
    from tests.sft.test_sft_parallel import _write_data

    data = _write_data(tmp_path / "chat.jsonl")
    flags = [flag for flag in BASE if flag != "--mock-data"]
    return flags + SAMPLES_RUN + ["--vocab-size", "64", "--sft", "--tokenizer-type", "NullTokenizer",
                                  "--train-data-path", data, "--valid-data-path", data, "--test-data-path", data,
                                  "--eval-interval", "3", "--save", str(tmp_path / "ckpt")]  # the last value counts


def test_ramp_up_with_fine_tuning_data(tmp_path, capsys):
    """The SFT iterators follow the ramp-up: the same batches as pretraining, a resume mid-ramp continues the
    uninterrupted run's data and losses, and validation and the test set run at the full batch."""
    from megatron_lite.training.loop import pretrain

    flags = _fine_tuning_run(tmp_path)
    pretrain(parse_args(flags))
    out = capsys.readouterr().out
    uninterrupted = _log_lines(out)
    assert [line["batch"] for line in uninterrupted] == [4, 4, 8, 12, 12, 12, 12]
    assert [line["consumed"] for line in uninterrupted] == [4, 8, 16, 28, 40, 52, 64]
    assert "validation loss at iteration 3 " in out and "validation loss at iteration 6 " in out
    assert "test set" in out
    storage.write_latest_iteration(str(tmp_path / "ckpt"), 2)
    pretrain(parse_args(flags + ["--load", str(tmp_path / "ckpt")]))
    assert _log_lines(capsys.readouterr().out) == uninterrupted[2:]


def test_fine_tuning_ramp_up_under_data_parallelism_matches_one_process(tmp_path):
    flags = _fine_tuning_run(tmp_path)
    (reference,) = run_distributed(_train_losses, 1, args=(flags,))
    for losses, consumed in run_distributed(_train_losses, 2, args=(flags,)):
        assert consumed == 64 and losses == pytest.approx(reference[0], rel=1e-5)
