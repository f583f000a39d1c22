"""What a DeepSpeed user is told (issue 42, items 2-4): a misspelled key is named with the key it is closest to,
an error caused by a value from the file names the file's key, and ZeRO on a layout where it does not do what
DeepSpeed would is said in one note."""
import json
import os

import pytest

from megatron_lite.cli.arguments import parse_args
from megatron_lite.cli.deepspeed_config import translate, translate_deepspeed_flags
from megatron_lite.config import ConfigError
from tests.test_deepspeed_config import CONFIGS, MODEL

Z2 = os.path.join(CONFIGS, "ds_z2_config.json")


def test_a_misspelled_key_is_named_with_the_key_it_meant():
    """Found by a new user: `gradient_clippping` was listed under "Remove these keys"; obeying loses clipping."""
    config = {"gradient_clippping": 1.0, "zero_optimization": {"stage": 2, "overlap_com": True},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
              "gradient_accumulation_dtype": "fp32", "csv_monitor": {"enabled": True}}
    with pytest.raises(ConfigError) as raised:
        translate(config, {}, 2, source="ds.json")
    assert str(raised.value) == (
        "--deepspeed-config ds.json: megatron_lite does not implement gradient_accumulation_dtype; csv_monitor. "
        "unknown keys gradient_clippping (did you mean gradient_clipping?); zero_optimization.overlap_com (did you "
        "mean zero_optimization.overlap_comm?); scheduler.params.warmup_num_step (did you mean "
        "scheduler.params.warmup_num_steps?). Correct the misspelled keys and remove any others (the table of "
        "supported keys is in docs/coming_from_hf_and_deepspeed.md).")
    # DeepSpeed's own keys, and a known key with a value we do not honour, are no misspellings.
    with pytest.raises(ConfigError, match=r"does not implement prescale_gradients true\. Remove these keys"):
        translate({"prescale_gradients": True}, {}, 1, source="ds.json")


def _file(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_an_error_caused_by_the_file_names_its_key_not_a_flag(tmp_path):
    """Found by a new user: warmup_num_steps 10 with --train-iters 3 said `--lr-warmup-iters (10) must be smaller
    than --lr-decay-iters`, a flag they never typed."""
    path = _file(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    with pytest.raises(ConfigError) as raised:
        parse_args([*MODEL, "--deepspeed-config", path])  # MODEL trains 3 iterations
    assert str(raised.value) == (f"{path}'s scheduler.params.warmup_num_steps (10) must be smaller than "
                                 "--lr-decay-iters (3, default --train-iters): lower the warmup or lengthen the decay.")
    # A flag the user gave (the file agreeing with it) keeps its own name.
    with pytest.raises(ConfigError, match=r"^--lr-warmup-iters \(10\) must be smaller than --lr-decay-iters \(3"):
        parse_args([*MODEL, "--deepspeed-config", path, "--lr-warmup-iters", "10"])
    # The whole flag only: the file's optimizer.params.lr is not in --lr-decay-iters.
    path = _file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_num_steps \(10\) must be smaller than "
                                          r"--lr-decay-iters \(3"):
        parse_args([*MODEL, "--deepspeed-config", path])


def _notes(world_size: int, **flags) -> list:
    return translate_deepspeed_flags({"deepspeed_config": Z2, **flags}, world_size)[1][2:]


def test_zero_over_one_data_parallel_rank_and_zero2_beside_pipelines_are_said_once():
    """Found by a new user: stage 3 with --pipeline-model-parallel-size 2 on 2 processes ran at data-parallel
    size 1, sharding nothing, and silently, where DeepSpeed refuses ZeRO-2/3 with pipeline parallelism."""
    note, = _notes(2, pipeline_model_parallel_size=2)
    assert note == (
        f"--deepspeed-config {Z2}: zero_optimization.stage 2 shards over the data-parallel ranks, and this run has "
        "one (2 processes / tensor 1 x pipeline 2 x context 1), so the sharding saves no memory: add processes or "
        "lower the model-parallel sizes; DeepSpeed refuses ZeRO stage 2 with pipeline parallelism (its pipeline "
        "engine takes stages 0 and 1 only); megatron_lite runs it (--data-parallel-sharding-strategy optim_grads "
        "with --pipeline-model-parallel-size 2), so this file and these flags would not run on DeepSpeed.")
    assert _notes(4, pipeline_model_parallel_size=2)[0].endswith("so this file and these flags would not run on "
                                                                   "DeepSpeed.")  # data-parallel 2: sharded
    assert "saves no memory" in _notes(2, tensor_model_parallel_size=2)[0]
    assert _notes(2) == []  # ZeRO-2 over 2 data-parallel ranks is what DeepSpeed does


def test_the_note_is_printed_at_start_up(capsys):
    parse_args([*MODEL, "--deepspeed-config", Z2, "--micro-batch-size", "2", "--global-batch-size", "2"])
    assert "zero_optimization.stage 2 shards over the data-parallel ranks, and this run has one (1 processes" \
        in capsys.readouterr().out
