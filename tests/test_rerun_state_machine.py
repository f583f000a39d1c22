"""Re-run on a suspicious result (issue 40): Megatron-LM's --rerun-mode, --error-injection-rate/-type.

Every path is driven by error injection through the loop the trainer runs (``pretrain``), on two real gloo
ranks (data-parallel, two micro-batches each, dropout on, so the re-run must restore the random states and
replay the micro-batches to come out the same). A transient fault and a correct result leave the losses and
grad norms of an uninterrupted run, bit for bit; a persistent one stops the run naming iteration, rank and
samples, after saving the state before that iteration, from which a resumed run trains on as the
uninterrupted one did.
"""
import contextlib
import io
import math
import random
import re

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)
from megatron_lite.data.data_samplers import MegatronPretrainingSampler
from megatron_lite.training.rerun_state_machine import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, SpikeDetector,
                                                        rank_samples, relative_difference)

TRAIN_ITERS = 4
SEED = 1234
PERSISTENT_RATE = 3  # one validation in 3 rejected: the first hit comes after iteration 1 for SEED (checked below)


def _config(save=None, load=None, save_interval=None, **training):
    return Config(model=ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64,
                                    init_method_std=0.1),
                  parallel=ParallelConfig(),
                  training=TrainingConfig(micro_batch_size=1, global_batch_size=4, train_iters=TRAIN_ITERS,
                                          seed=SEED, eval_interval=1000, eval_iters=1, **training),
                  optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.5), data=DataConfig(mock_data=True),
                  checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval),
                  logging=LoggingConfig(log_interval=1, log_memory=False))


def _train(config):
    """(losses, grad norms as logged, output, error or None) of one run on this rank."""
    from megatron_lite.process_groups.failures import FailedOnAnotherRank
    from megatron_lite.training.loop import pretrain
    from megatron_lite.training.rerun_state_machine import ResultValidationError

    output, error, losses = io.StringIO(), None, None
    with contextlib.redirect_stdout(output):
        try:
            losses = pretrain(config, keep_process_group=True)[0].losses
        except (ResultValidationError, FailedOnAnotherRank) as caught:
            error = (type(caught).__name__, str(caught), caught.exit_code)
    text = output.getvalue()
    return losses, re.findall(r"grad norm: ([\d.]+)", text), text, error


def _every_path(rank, world_size, root):
    runs = {"uninterrupted": _train(_config()),
            "transient": _train(_config(error_injection_rate=2, error_injection_type="transient_error")),
            "correct": _train(_config(error_injection_rate=2, error_injection_type="correct_result")),
            "report_stats": _train(_config(rerun_mode="report_stats")),
            "persistent": _train(_config(save=root, save_interval=100, error_injection_rate=PERSISTENT_RATE,
                                         error_injection_type="persistent_error"))}
    runs["latest after the stop"] = storage.read_latest_iteration(root)
    runs["resumed"] = _train(_config(save=root, load=root))
    return runs


def _first_persistent_hit(world_size):
    """(iteration, rank) of the first injection: one draw per iteration from a generator seeded with --seed,
    rank r hit when (draw + r) % rate == 0."""
    generator = random.Random(SEED)
    for iteration in range(1, TRAIN_ITERS + 1):
        draw = generator.randrange(PERSISTENT_RATE)
        for rank in range(world_size):
            if (draw + rank) % PERSISTENT_RATE == 0:
                return iteration, rank
    raise AssertionError("no injection within the run")


def test_every_injected_fault_takes_its_path(run_distributed, tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = run_distributed(_every_path, 2, args=(root,))
    last = ranks[-1]
    losses, grad_norms, _, _ = last["uninterrupted"]
    assert len(losses) == TRAIN_ITERS and len(grad_norms) == TRAIN_ITERS and all(map(math.isfinite, losses))
    assert float(grad_norms[0]) > 0.5  # clipped: the re-run must reproduce the clip too
    every_output = {name: "".join(rank[name][2] for rank in ranks) for name in ranks[0]
                    if isinstance(ranks[0][name], tuple)}

    # A transient fault: the re-run differs, training goes on with it, every iteration of an uninterrupted run.
    assert last["transient"][:2] == (losses, grad_norms)
    assert every_output["transient"].count("a transient fault; training goes on") >= TRAIN_ITERS
    # A correct result: the re-run reproduces a sound result, nothing was wrong.
    assert last["correct"][:2] == (losses, grad_norms)
    assert every_output["correct"].count("reproduces a sound result: nothing was wrong") >= TRAIN_ITERS
    # report_stats: every iteration re-run, and its results were identical (CPU arithmetic is deterministic).
    assert last["report_stats"][:2] == (losses, grad_norms)
    stats = re.findall(r"re-run statistics .* loss (\d+)/(\d+) identical.* grad norm (\d+)/(\d+) identical",
                       every_output["report_stats"])
    assert len(stats) == TRAIN_ITERS and all(pair == ("2", "2", "2", "2") for pair in stats), stats

    # A persistent fault: the run stops at the injected iteration, the injected rank reporting, every rank exit 17.
    iteration, rank = _first_persistent_hit(2)
    assert iteration >= 2
    errors = [r["persistent"][3] for r in ranks]
    assert errors[rank][0] == "ResultValidationError" and errors[1 - rank][0] == "FailedOnAnotherRank"
    assert all(error[2] == EXIT_CODE_FAILED_ON_RESULT_VALIDATION for error in errors)
    message = errors[rank][1]
    first = (iteration - 1) * 4
    assert f"iteration {iteration}: " in message and f"on rank {rank}" in message, message
    assert f"training samples {first}-{first + 3}; this rank's {first + rank}, {first + 2 + rank}" in message
    assert "--error-injection-type persistent_error" in message
    assert last["persistent"][0] is None
    # What it saved is the state before that iteration: a resumed run trains on as the uninterrupted one.
    assert last["latest after the stop"] == iteration - 1
    resumed_losses, resumed_norms, _, resumed_error = last["resumed"]
    assert resumed_error is None and resumed_losses == losses and resumed_norms == grad_norms[iteration - 1:]


def test_rank_samples_are_the_samplers():
    """The samples the error names are those the data loader gives each rank's micro-batches."""
    for dp_rank in range(2):
        sampler = MegatronPretrainingSampler(total_samples=100, consumed_samples=12, micro_batch_size=3,
                                             data_parallel_rank=dp_rank, data_parallel_size=2)
        batches = iter(sampler)
        expected = [next(batches) for _ in range(2)]
        assert [list(r) for r in rank_samples(12, 2, 3, 2, dp_rank)] == expected


def test_a_spike_is_ten_times_the_largest_of_the_first_hundred():
    detector = SpikeDetector(10)
    for value in [1.0] * 99 + [2.0]:
        assert not detector.is_spike(100.0)  # still learning what is normal
        detector.observe(value)
    assert not detector.is_spike(19.9) and detector.is_spike(20.0) and detector.is_spike(-20.0)
    assert not detector.is_spike(math.nan) and not detector.is_spike(math.inf)  # the NaN check's
    detector.observe(1000.0)  # past the first hundred: the reference stays
    assert detector.is_spike(20.0)


@pytest.mark.parametrize("a, b, difference", [(1.0, 1.0, 0.0), (math.nan, math.nan, 0.0), (math.inf, math.inf, 0.0),
                                              (math.inf, -math.inf, math.inf), (1.0, math.nan, math.inf),
                                              (2.0, 1.0, 0.5)])
def test_relative_difference(a, b, difference):
    assert relative_difference(a, b) == difference


def test_the_flags_parse_and_injection_needs_validation():
    from megatron_lite.cli.arguments import parse_args
    from megatron_lite.config import ConfigError

    base = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--vocab-size", "64", "--mock-data"]
    training = parse_args([*base, "--rerun-mode", "report_stats", "--check-for-spiky-loss", "--check-for-large-grads",
                           "--log-straggler"]).training
    assert (training.rerun_mode, training.check_for_spiky_loss, training.check_for_large_grads) == \
        ("report_stats", True, True)
    with pytest.raises(ConfigError, match="--error-injection-rate .* only --rerun-mode validate_results"):
        parse_args([*base, "--rerun-mode", "disabled", "--error-injection-rate", "10"])
    with pytest.raises(ConfigError, match="--error-injection-type"):
        parse_args([*base, "--error-injection-type", "bit_flip"])
