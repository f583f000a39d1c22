"""Samples-based runs, batch-size ramp-up and step schedules, against Megatron-LM's formulas.

--train-samples gives the run's length in samples (iterations derived as Megatron's
update_train_iters does), the LR schedule counts samples, and --rampup-batch-size grows the
global batch as Megatron's RampupBatchsizeNumMicroBatchesCalculator, --step-batch-size-schedule as
Megatron-Core 0.20's StepBatchsizeNumMicroBatchesCalculator: the loop, the data position, consumed
samples, checkpoints and the log line follow them, and only the batches ahead of a run must divide
over its replicas.
"""
import math
import os
import re

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import parse_args
from megatron_lite.training.num_microbatches_calculator import (NumMicroBatchesCalculator,
                                                                build_num_microbatches_calculator)
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
    ([2, 2, 16], r"--rampup-batch-size: the global batch 2 \(from 0 consumed samples on\) must be divisible by "
               r"--micro-batch-size \(2\) x data-parallel size \(2\) = 4"),
    ([4, 4, 0], "must all be positive"),
])
def test_bad_ramp_ups_name_the_flag(rampup, match):
    with pytest.raises(ConfigError, match=match):
        NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=2,
                                  rampup_batch_size=rampup).check_batches_ahead(0)


def test_only_the_ramp_up_batches_ahead_must_divide():
    """Batches 2, 4, 6, 8, 10, 12 over 20 samples (a step every 4): at micro 2 x dp 2 the 2, 6 and 10 do not split,
    so a run resumes on two replicas only once the batch 10 is behind it; the final batch is named by its flag."""
    calculator = NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=2,
                                           rampup_batch_size=[2, 2, 20])
    assert [calculator.get_current_global_batch_size(c) for c in (0, 3, 4, 15, 16, 19, 20, 21)] == [
        2, 2, 4, 8, 10, 10, 12, 12]
    with pytest.raises(ConfigError, match=r"global batch 10 \(from 16 consumed samples on\)"):
        calculator.check_batches_ahead(16)
    calculator.check_batches_ahead(20)
    assert calculator.microbatch_counts(20) == [3]
    with pytest.raises(ConfigError, match=r"^--global-batch-size \(12\) must be divisible by --micro-batch-size "
                                          r"\(2\) x data-parallel size \(4\) = 8"):
        NumMicroBatchesCalculator(global_batch_size=12, micro_batch_size=2, data_parallel_size=4,
                                  rampup_batch_size=[8, 4, 20]).check_batches_ahead(0)


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
                                "--lr-warmup-fraction", "0.05", "--lr", "1.0", "--min-lr", "0.1",
                                "--lr-decay-style", "cosine"])
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


# --step-batch-size-schedule (Megatron-Core 0.20's StepBatchsizeNumMicroBatchesCalculator)

GPT3_175B_SCHEDULE = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"


def megatron_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """StepBatchsizeNumMicroBatchesCalculator._parse_schedule, restated from Megatron-Core (float parsing)."""
    def number(value):
        value = value.strip().upper()
        multiplier = {"T": 10**12, "B": 10**9, "M": 10**6, "K": 10**3}.get(value[-1:], 1)
        return int(float(value[:-1] if multiplier > 1 else value) * multiplier)

    pairs = [entry.split(":", 1) for entry in text.strip().replace(",", " ").split()]
    return sorted((number(threshold) // seq_length, number(batch)) for threshold, batch in pairs)


def megatron_step_batch(consumed: int, schedule: list[tuple[int, int]]) -> int:
    """_get_batch_size_for_samples, restated."""
    batch = schedule[0][1]
    for threshold, size in schedule:
        if consumed < threshold:
            break
        batch = size
    return batch


def megatron_step_train_iters(train_samples: int, schedule: list[tuple[int, int]]) -> int:
    """update_train_iters with a step schedule, restated: one iteration at a time."""
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += megatron_step_batch(consumed, schedule)
        iterations += 1
    return iterations


def _schedule_config(schedule: str, *extra: str):
    return parse_args(BASE + ["--step-batch-size-schedule", schedule, *extra])


def _step_calculator(schedule, micro_batch_size=1, data_parallel_size=1):
    return NumMicroBatchesCalculator(global_batch_size=schedule[-1][1], micro_batch_size=micro_batch_size,
                                     data_parallel_size=data_parallel_size, step_batch_size_schedule=schedule)


@pytest.mark.parametrize("text, tokens", [
    (GPT3_175B_SCHEDULE, [(0, 16), (2_400_000_000, 320), (4_800_000_000, 624), (7_200_000_000, 928),
                          (9_600_000_000, 1232), (12_000_000_000, 1536)]),
    ("12B:1536, 0:16,2.4b:320", [(0, 16), (2_400_000_000, 320), (12_000_000_000, 1536)]),  # commas, any order
    ("0:16 1.5K:32 2M:64 0.001T:0.128K 7:16", [(0, 16), (7, 16), (1500, 32), (2_000_000, 64), (10**9, 128)]),
])
def test_schedule_parses_as_megatron(text, tokens):
    from megatron_lite.config.batch_size_schedule import parse_step_batch_size_schedule

    assert parse_step_batch_size_schedule(text) == tokens == megatron_step_schedule(text, seq_length=1)


def test_schedule_thresholds_are_tokens_divided_by_seq_length():
    """--seq-length 16: 0.16K tokens = sample 10, 330 tokens = sample 20 (floored); the last batch is the
    global batch, and the batch changes exactly at each threshold."""
    config = _schedule_config("0:4 0.16K:8 330:12")
    assert config.training.global_batch_size == 12 and config.training.global_batch(7) == 12
    schedule = config.training.step_schedule_in_samples(16)
    assert schedule == [(0, 4), (10, 8), (20, 12)] == megatron_step_schedule("0:4 0.16K:8 330:12", 16)
    calculator = _step_calculator(schedule, micro_batch_size=2, data_parallel_size=2)
    expected = {0: 4, 9: 4, 10: 8, 11: 8, 19: 8, 20: 12, 21: 12, 10**9: 12}
    assert {c: calculator.get_current_global_batch_size(c) for c in expected} == expected
    assert [calculator.get_num_microbatches(c) for c in (9, 10, 20)] == [1, 2, 3]
    assert calculator.microbatch_counts() == [1, 2, 3] and calculator.microbatch_counts(15) == [2, 3]


def test_gpt3_175b_schedule_at_full_size():
    """The script's own schedule at --seq-length 2048, to 300B tokens: each iteration as Megatron counts it
    (~100k iterations one by one) against the calculator's step-at-a-time count."""
    schedule = megatron_step_schedule(GPT3_175B_SCHEDULE, 2048)
    calculator = _step_calculator(schedule)
    assert calculator.schedule == schedule and schedule[1] == (1_171_875, 320)
    train_samples = 300 * 10**9 // 2048
    iterations = megatron_step_train_iters(train_samples, schedule)
    assert calculator.iterations_for(train_samples) == iterations
    assert calculator.consumed_samples_after(iterations) >= train_samples > calculator.consumed_samples_after(
        iterations - 1)


@pytest.mark.parametrize("seed", range(20))
def test_step_schedule_iterations_match_per_iteration_simulation(seed):
    """Random schedules (thresholds within or between batches, runs ending inside or past them):
    iterations_for and consumed_samples_after against Megatron's one-iteration-at-a-time loop."""
    import random

    rng = random.Random(seed)
    thresholds = [0] + sorted(rng.sample(range(1, 400), rng.randint(0, 5)))
    batches = sorted(rng.randint(1, 64) for _ in thresholds)
    schedule = list(zip(thresholds, batches))
    calculator = _step_calculator(schedule)
    for train_samples in [1, batches[0], *(t + d for t in thresholds for d in (-1, 0, 1) if t + d > 0),
                          rng.randint(1, 2000), 5000]:
        assert calculator.iterations_for(train_samples) == megatron_step_train_iters(train_samples, schedule)
    consumed = 0
    for iterations in range(300):
        assert calculator.consumed_samples_after(iterations) == consumed
        consumed += megatron_step_batch(consumed, schedule)


@pytest.mark.parametrize("seed", range(20))
def test_ramp_up_as_steps_matches_megatrons_formula(seed):
    """The ramp-up becomes a step schedule found by bisection over Megatron's float formula: same batch at
    every sample (also when increments come faster than one per sample), same iterations as Megatron's
    update_train_iters ramp-up loop."""
    import random

    rng = random.Random(seed)
    increment = rng.randint(1, 8)
    start, increments = rng.randint(1, 16), rng.randint(1, 40)
    global_batch, samples = start + increments * increment, rng.choice([rng.randint(1, 30), rng.randint(30, 3000)])
    rampup = [start, increment, samples]
    calculator = NumMicroBatchesCalculator(global_batch_size=global_batch, micro_batch_size=1, data_parallel_size=1,
                                           rampup_batch_size=rampup)
    for consumed in range(samples + 3):
        assert calculator.get_current_global_batch_size(consumed) == megatron_rampup_batch(consumed, global_batch,
                                                                                           *rampup)
    for train_samples in (1, samples // 2, samples, samples + 1, 3 * samples + 7):
        iterations = consumed = 0
        while consumed <= samples and consumed <= train_samples:
            consumed += megatron_rampup_batch(consumed, global_batch, *rampup)
            iterations += 1
        iterations += max(train_samples - consumed, 0) // global_batch
        assert calculator.iterations_for(train_samples) == iterations


@pytest.mark.parametrize("schedule, match", [
    ("0:16 2.4B", r"cannot read the entry '2.4B'; expected \"THRESHOLD:BATCH THRESHOLD:BATCH ...\""),
    ("0:16 2.4X:32", r"cannot read the entry '2.4X:32'; expected"),
    ("0:16 -5:32", r"cannot read the entry '-5:32'"),
    ("0:16:4", r"cannot read the entry '0:16:4'"),
    (" , ", " is empty; expected"),
    ("1K:16 2K:32", "the first threshold must be 0 .*got 1000 tokens"),
    ("0:16 1K:32 1000:64", "two entries at 1000 tokens"),
    ("0:0", "the entry '0:0' has batch 0; batch sizes must be positive"),
    ("0:32 1K:16", "the batch drops from 32 to 16 at 1000 tokens"),
    ("0:16 100:32 110:64", r"the thresholds 100 and 110 tokens are the same sample \(6\) at --seq-length 16"),
])
def test_bad_schedules_name_the_entry(schedule, match):
    with pytest.raises(ConfigError, match="^--step-batch-size-schedule.*" + match):
        _schedule_config(schedule)


def test_schedule_with_the_other_batch_flags():
    """--global-batch-size may repeat the last batch (Megatron-LM's own script does; Megatron-LM rejects the
    pair), never contradict it; the ramp-up is the other way to grow the batch."""
    assert _schedule_config(GPT3_175B_SCHEDULE, "--global-batch-size", "1536").training.global_batch_size == 1536
    with pytest.raises(ConfigError, match=r"--global-batch-size 1024 contradicts --step-batch-size-schedule, whose "
                                          r"last batch \(1536\) is the global batch"):
        _schedule_config(GPT3_175B_SCHEDULE, "--global-batch-size", "1024")
    with pytest.raises(ConfigError, match="--step-batch-size-schedule and --rampup-batch-size both set the batch"):
        _schedule_config(GPT3_175B_SCHEDULE, "--rampup-batch-size", "16", "16", "100")
    with pytest.raises(ConfigError, match=r"the last batch of --step-batch-size-schedule \(6\) must be divisible by "
                                          r"--micro-batch-size \(2\) x data-parallel size \(2\)"):
        _schedule_config("0:2 1K:6").training.num_microbatches(2)


# Thresholds 64 and 192 tokens = samples 4 and 12 at --seq-length 16.
SCHEDULE_RUN = ["--step-batch-size-schedule", "0:4 0.064K:8 192:12", "--train-samples", "40", "--lr", "1e-3",
                "--lr-warmup-samples", "8"]


def test_samples_run_with_step_schedule(tmp_path, capsys):
    """Batches 4 (from sample 0), 8 (from 4), 12 (from 12): 5 iterations, the last passing --train-samples 40 as
    Megatron's; a checkpoint whenever the micro-batch count changes (2 -> 4 -> 6) and at the end."""
    from megatron_lite.training.loop import pretrain

    state, _, _ = pretrain(parse_args(BASE + SCHEDULE_RUN + ["--save", str(tmp_path)]))
    out = capsys.readouterr().out
    assert ('192 tokens per iteration (stepped up by --step-batch-size-schedule "0:4 0.064K:8 192:12", in tokens), '
            '5 iterations') in out
    lines = _log_lines(out)
    assert [line["batch"] for line in lines] == [4, 8, 12, 12, 12]
    assert [line["consumed"] for line in lines] == [4, 12, 24, 36, 48]
    assert state.iteration == 5 and state.consumed_train_samples == 48
    schedule, consumed_before = megatron_step_schedule("0:4 0.064K:8 192:12", 16), [0, 4, 12, 24, 36]
    assert [line["batch"] for line in lines] == [megatron_step_batch(c, schedule) for c in consumed_before]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000002", "iter_0000005",
                                            "latest_checkpointed_iteration.txt"]


# micro-batch 1: batches 1 (samples 0-1), 2 (2-5), 4 (6 on): 1, 1, 2, 2, 4, 4 over 14 samples.
RESUME_RUN = ["--micro-batch-size", "1", "--step-batch-size-schedule", "0:1 32:2 96:4", "--train-samples", "14"]


def _resume_body(rank, world_size, flags, no_training):
    from megatron_lite.training import loop

    if no_training:
        loop.train = _no_training
    try:
        state, _, _ = loop.pretrain(parse_args(flags), keep_process_group=True)
    except ConfigError as error:
        return str(error)
    return state.losses, state.consumed_train_samples


def test_resume_on_more_replicas_once_the_odd_batches_are_behind(tmp_path):
    """A dp1 run saves when its batch grows from 1 to 2 (iteration 2); dp2 resumes there and trains the
    uninterrupted run's samples, losses equal. Resumed before the batch 1 it could not split (nor the
    2 at micro-batch 2 x dp2) it fails after the load, on every rank, before a step."""
    flags = BASE + RESUME_RUN + ["--save", str(tmp_path)]
    ((reference, consumed),) = run_distributed(_resume_body, 1, args=(flags, False))
    assert consumed == 14 and len(reference) == 6
    assert "iter_0000002" in os.listdir(tmp_path)
    storage.write_latest_iteration(str(tmp_path), 2)
    resumed = flags + ["--load", str(tmp_path)]
    for losses, consumed in run_distributed(_resume_body, 2, args=(resumed, False)):
        assert consumed == 14 and losses == pytest.approx(reference, rel=1e-5)  # the first 2 restored
    storage.write_latest_iteration(str(tmp_path), 2)
    for error in run_distributed(_resume_body, 2, args=(resumed + ["--micro-batch-size", "2"], True)):
        assert error.startswith("--step-batch-size-schedule: the global batch 2 (from 2 consumed samples on) must be "
                                "divisible by --micro-batch-size (2) x data-parallel size (2) = 4")


def test_interleaving_checks_the_micro_batch_counts_ahead():
    """Counts 1, 2, 4 with 2 pipeline stages interleaved: a fresh run fails on the 1, a resume past it runs."""
    from megatron_lite.training.loop import check_batches_ahead

    config = parse_args(BASE + RESUME_RUN + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                             "--num-layers-per-virtual-pipeline-stage", "1"])
    calculator = build_num_microbatches_calculator(config, data_parallel_size=1)
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        check_batches_ahead(config, calculator, consumed_samples=0)
    check_batches_ahead(config, calculator, consumed_samples=2)


def _no_model(*args, **kwargs):
    raise AssertionError("the model was built: the start-up check let the schedule through")


def _fresh_body(rank, world_size, flags):
    from megatron_lite.training import loop

    loop.get_model = _no_model
    try:
        loop.pretrain(parse_args(flags), keep_process_group=True)
    except ConfigError as error:
        return str(error)


def test_fresh_run_with_a_batch_it_cannot_split_fails_at_start_up(tmp_path):
    """The same schedule started fresh on two replicas (also with an empty --load): the batch 1 fails before the
    model is built."""
    for flags in (BASE + RESUME_RUN, BASE + RESUME_RUN + ["--load", str(tmp_path)]):
        for error in run_distributed(_fresh_body, 2, args=(flags,)):
            assert error.startswith("--step-batch-size-schedule: the global batch 1 (from 0 consumed samples on) "
                                    "must be divisible by --micro-batch-size (1) x data-parallel size (2) = 2")
