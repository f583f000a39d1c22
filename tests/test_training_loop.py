"""The loop's bookkeeping in one process: log lines, TensorBoard scalars, end and exit saves."""
import os

import pytest

from megatron_lite.training import data_iterators, loop
from megatron_lite.training.logger import TrainingLogger
from megatron_lite.checkpointing.training_state import TrainingState
from megatron_lite.cli.arguments import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1", "--lr", "1e-3"]


def _tensorboard_scalars(log_dir) -> set:
    """(tag, step) of every scalar in the event files under ``log_dir``, read back with tensorboard itself."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(log_dir))
    events.Reload()
    return {(tag, event.step) for tag in events.Tags()["scalars"] for event in events.Scalars(tag)}


def test_log_lines_tensorboard_and_final_save(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    config = parse_args(BASE + ["--train-iters", "5", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                                "--tensorboard-dir", str(tmp_path / "tb")])
    state, _, _ = loop.pretrain(config)
    out = capsys.readouterr().out
    assert state.iteration == 5 and state.consumed_train_samples == 20 and len(state.losses) == 5
    assert sum(line.startswith(" iteration ") for line in out.splitlines()) == 2
    assert " iteration        4/       5 |" in out
    assert out.count(" validation loss at iteration ") == 2 and "memory per rank (MB)" in out
    assert out.count(" memory per rank in iteration 1 (MB) | parameters (peak): ") == 1  # once, after the first
    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert ("lm loss", 2) in scalars and ("lm loss validation", 4) in scalars
    # Saved every 2 iterations and once more at the end, as Megatron does.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000002", "iter_0000004", "iter_0000005",
                                                      "latest_checkpointed_iteration.txt"]


def test_exit_interval_saves_and_stops(tmp_path):
    config = parse_args(BASE + ["--train-iters", "6", "--exit-interval", "3", "--save", str(tmp_path / "ckpt")])
    state, _, _ = loop.pretrain(config)
    assert state.iteration == 3
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_eod_mask_loss_needs_a_tokenizer():
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match="--eod-mask-loss needs --tokenizer-type"):
        parse_args(BASE + ["--eod-mask-loss"])


def _build_datasets_from_a_missing_prefix(rank, world_size, prefix):
    config = parse_args([f for f in BASE if f != "--mock-data"] + ["--data-path", prefix])
    try:
        data_iterators._build_datasets(config, (8, 0, 0), train_iters=1)
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return type(error).__name__, str(error)
    return None


def test_a_failing_dataset_builder_fails_every_rank(tmp_path):
    """Rank 0 builds the indices while rank 1 waits for them: when rank 0 fails, rank 1 must raise
    too rather than wait for a cache that will never come."""
    from tests.distributed import run_distributed

    results = run_distributed(_build_datasets_from_a_missing_prefix, 2, args=(str(tmp_path / "missing"),),
                              timeout=60)
    assert results[0] is not None and "missing" in results[0][1]
    assert results[1] == ("FailedOnAnotherRank", "rank 0 failed to build the datasets; its error message says why.")


class _Optimizer:
    param_groups = [{"lr": 1e-3}]

    def get_loss_scale(self):
        return 1024.0


def test_log_line_counts_the_interval_as_megatron_does(capsys):
    """Skipped iterations do not enter the mean loss; skipped and NaN counts restart every interval."""
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel

    config = parse_args(BASE + ["--train-iters", "6", "--no-log-memory"])
    logger = TrainingLogger(config, initialize_model_parallel(1, 1), train_iters=6)
    state = TrainingState()
    for iteration, (loss, skipped) in enumerate([(2.0, False), (9.0, True), (float("nan"), True), (4.0, False)], 1):
        logger.record(loss, 0.1, skipped=skipped, global_batch=4)
        state.iteration = iteration
        if iteration in (2, 4):
            logger.log_interval(state, _Optimizer(), grad_norm=None)
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    assert "lm loss: 2.000000E+00" in first and "skipped iterations:   1 |" in first and "nan iterations:   0" in first
    assert "lm loss: 4.000000E+00" in second and "skipped iterations:   1 |" in second
    assert "nan iterations:   1 |" in second and "loss scale: 1024.0" in second


def test_user_errors_print_the_fix_without_a_traceback(tmp_path, capsys):
    from megatron_lite.pretrain_gpt import main

    flags = [f for f in BASE if f != "--mock-data"] + ["--train-iters", "1", "--data-path", str(tmp_path / "none")]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "--data-path" in err and "prefix without .bin/.idx" in err


def test_start_up_summary_counts_parameters_per_stage_and_the_batch():
    import dataclasses

    from megatron_lite.config import ParallelConfig
    from megatron_lite.model.builder import count_parameters
    from megatron_lite.process_groups.parallel_state import mock_parallel_state
    from megatron_lite.training.logger import format_startup_summary
    from megatron_lite.training.num_microbatches_calculator import build_num_microbatches_calculator
    from megatron_lite.training.run_plan import RunPlan

    config = parse_args(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                         "32", "--vocab-size", "1000", "--mock-data", "--pipeline-model-parallel-size", "2",
                         "--micro-batch-size", "2", "--global-batch-size", "16", "--save", "/ckpt"])
    parallel_state = mock_parallel_state(rank=0, world_size=4, tensor_model_parallel_size=1,
                                         pipeline_model_parallel_size=2)
    counts = count_parameters(config)
    total, stages = counts.total, counts.per_stage
    embedding = config.model.padded_vocab_size(1) * 64  # tied: held by the first and the last stage
    assert sum(stages) == total + embedding and len(stages) == 2
    assert total == count_parameters(dataclasses.replace(config, parallel=ParallelConfig())).total  # one stage
    plan = RunPlan(calculator=build_num_microbatches_calculator(config, data_parallel_size=2), train_iters=100,
                   parameters=counts, checkpoint=None)
    summary = format_startup_summary(config, parallel_state, plan)
    assert f"{total:,} parameters" in summary
    assert "4 processes = tensor 1 x pipeline 2 x data 2" in summary
    assert "16 sequences = micro-batch 2 x 4 micro-batches x data 2; 512 tokens per iteration" in summary
    assert "to /ckpt at the end" in summary


def _bucket_reductions_at_finalize(rank, world_size):
    """One trainer iteration (pretrain -> train_step -> the interleaved schedule) with --overlap-grad-reduce;
    returns, per model chunk, whether each bucket's data-parallel reduction had been launched when the
    schedule called finalize_model_grads."""
    from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig

    seen = []

    def finalize(model_chunks, num_tokens, parallel_state):  # the trainer's finalize, as the schedule calls it
        seen.append([[(bucket.grad_sync_started, bucket.grad_handle is not None) for bucket in chunk.buckets]
                     for chunk in model_chunks])
        finalize_model_grads(model_chunks, num_tokens, parallel_state=parallel_state)

    finalize_model_grads, loop.finalize_model_grads = loop.finalize_model_grads, finalize
    config = Config(
        model=ModelConfig(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=128),
        # pp 2 x vpp 2: each rank holds two one-layer chunks; 2000-element buckets give each chunk several.
        parallel=ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                overlap_grad_reduce=True, ddp_bucket_size=2000),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=4, train_iters=1, eval_iters=1),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))
    loop.pretrain(config)
    return seen


def test_interleaved_overlap_reduces_every_chunks_buckets_during_backward():
    from tests.distributed import run_distributed

    # pp 2 x dp 2: a bucket's reduction is a real all-reduce, launched by the last gradient that fills it.
    for seen in run_distributed(_bucket_reductions_at_finalize, 4):
        assert len(seen) == 1 and len(seen[0]) == 2  # one iteration, two chunks per rank
        for chunk, buckets in enumerate(seen[0]):
            assert len(buckets) > 1, buckets
            assert buckets == [(True, True)] * len(buckets), f"chunk {chunk}: {buckets}"
