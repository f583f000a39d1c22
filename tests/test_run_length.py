"""How long a run is, said at start-up: --train-epochs counted into iterations (from the data and the batch
schedule), the default length named when none is given, and a note when the LR decay ends before training."""
import json
import re

import numpy as np
import pytest

from megatron_lite import pretrain_gpt
from megatron_lite.cli.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.data import IndexedDatasetBuilder
from megatron_lite.data.indexed_dataset import data_file_path, index_file_path
from megatron_lite.data.sft import SFTDataset, load_sft_examples
from megatron_lite.model.builder import count_parameters
from megatron_lite.process_groups.parallel_state import mock_parallel_state
from megatron_lite.tokenizer import build_model_tokenizer
from megatron_lite.training.logger import format_startup_summary
from megatron_lite.training.num_microbatches_calculator import build_num_microbatches_calculator
from megatron_lite.training.run_plan import RunPlan, iterations_of_epochs

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
        "--eval-iters", "0", "--vocab-size", "64"]
LOG_LINE = re.compile(r" iteration +(\d+)/ +(\d+) \|.*learning rate: ([0-9.E+-]+) \|")


def _corpus(prefix: str, documents: int = 4, tokens: int = 40) -> str:
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for _ in range(documents):
        builder.add_document(np.arange(tokens, dtype=np.uint16) % 60)
    builder.finalize(index_file_path(prefix))
    return prefix


def _sft_data(path, count: int) -> str:
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": " ".join(map(str, range(i % 5 + 1))), "response": "7 8"}) + "\n")
    return str(path)


def _log(output: str) -> list[tuple[int, int, float]]:
    return [(int(a), int(b), float(lr)) for a, b, lr in LOG_LINE.findall(output)]


def test_epochs_of_pretraining_data_run_the_iterations_the_summary_states(tmp_path, capsys):
    # 4 documents of 40 tokens, all in the train split: (160 - 1) // 16 = 9 samples a pass; 2 passes are 18,
    # which batches of 4 cover in 5 iterations (20 samples). The LR decays over those 5 iterations.
    prefix = _corpus(str(tmp_path / "corpus_text_document"))
    assert pretrain_gpt.main([*TINY, "--global-batch-size", "4", "--data-path", prefix, "--split", "100,0,0",
                              "--train-epochs", "2", "--lr", "1e-3", "--min-lr", "1e-4",
                              "--lr-decay-style", "linear"]) == 0
    output = capsys.readouterr().out
    assert "5 iterations (--train-epochs 2 of 9 samples = 18 samples, 20 in whole batches)" in output
    log = _log(output)
    assert [(i, n) for i, n, _ in log] == [(i, 5) for i in range(1, 6)]
    # As --train-iters 5 would: linear from 1e-3 at sample 0 to 1e-4 at the decay's end (5 x 4 samples); the
    # line shows the LR after its iteration's scheduler step (Megatron's), the one the next iteration uses.
    assert [lr for _, _, lr in log] == pytest.approx([1e-3 - 9e-4 * k / 5 for k in range(1, 6)], rel=1e-3)
    assert "note: no --train-iters" not in output and "decay ends before" not in output


def _plan_iterations(args: list[str]):
    config = parse_args(args)
    return iterations_of_epochs(config, build_num_microbatches_calculator(config, data_parallel_size=1)), config


def test_epochs_follow_a_batch_ramp_up(tmp_path):
    prefix = _corpus(str(tmp_path / "c_text_document"), documents=10)  # 399 // 16 = 24 samples a pass
    args = [*TINY, "--global-batch-size", "8", "--data-path", prefix, "--split", "100,0,0",
            "--rampup-batch-size", "2", "2", "16", "--train-epochs", "1.5"]
    (iterations, length), config = _plan_iterations(args)
    calculator = build_num_microbatches_calculator(config, data_parallel_size=1)
    consumed, expected = 0, 0
    while consumed < 36:  # 1.5 x 24 samples, batch by batch as the loop takes them: 2, 2, 4, 4, 6, 6, 8, ...
        consumed += calculator.get_current_global_batch_size(consumed)
        expected += 1
    assert iterations == expected
    assert length == f"--train-epochs 1.5 of 24 samples = 36 samples, {consumed} in whole batches"


def test_epochs_of_fine_tuning_data_padded_and_packed(tmp_path):
    data = _sft_data(tmp_path / "train.jsonl", 7)
    common = [*TINY, "--sft", "--tokenizer-type", "NullTokenizer", "--train-data-path", data,
              "--global-batch-size", "2", "--train-epochs", "1.5"]
    (iterations, length), _ = _plan_iterations(common)  # 7 examples a pass, one a sample: 11 samples, 6 batches
    assert (iterations, length) == (6, "--train-epochs 1.5 of 7 samples = 11 samples, 12 in whole batches")
    (iterations, length), config = _plan_iterations([*common, "--sft-pack-sequences"])
    # The packed dataset's own first pass has as many samples as the epoch counted: one more sample is a second.
    per_epoch = int(re.search(r"of (\d+) samples", length).group(1))
    examples = load_sft_examples([data], build_model_tokenizer(vars(config.data), 64), "plain")

    def passes(num_samples: int) -> str:
        dataset = SFTDataset(examples, seq_length=16, num_samples=num_samples, seed=config.training.seed,
                             pad_token=0, pack_sequences=True)
        return re.search(r"(\d+) epochs", dataset.describe()).group(1)

    assert 1 < per_epoch < 7 and (passes(per_epoch), passes(per_epoch + 1)) == ("1", "2")
    assert iterations == -(-int(np.ceil(1.5 * per_epoch)) // 2)


@pytest.mark.parametrize("extra, message", [
    (["--mock-data"], "--train-epochs counts passes over the training data, and --mock-data has no size"),
    (["--data-path", "0.5", "PREFIX", "0.5", "PREFIX"], "--train-epochs counts passes over one dataset, but "
                                                         "--data-path blends 2"),
])
def test_epochs_without_one_dataset_to_count_are_refused(tmp_path, extra, message):
    prefix = _corpus(str(tmp_path / "c_text_document"))
    with pytest.raises(ConfigError, match=message):
        _plan_iterations([*TINY, "--train-epochs", "1", *[prefix if a == "PREFIX" else a for a in extra]])


def test_epochs_take_one_length_and_the_lr_flags_of_iterations(tmp_path):
    prefix = _corpus(str(tmp_path / "c_text_document"))
    base = [*TINY, "--data-path", prefix, "--split", "100,0,0", "--train-epochs", "1"]
    with pytest.raises(ConfigError, match="--train-iters and --train-epochs are mutually exclusive"):
        parse_args([*base, "--train-iters", "3"])
    with pytest.raises(ConfigError, match="--lr-warmup-samples counts samples, but the run is given in iters"):
        parse_args([*base, "--lr-warmup-samples", "3"])
    (iterations, _), config = _plan_iterations([*base, "--lr-warmup-iters", "20"])  # 9 samples: 9 iterations
    with pytest.raises(ConfigError, match=r"--lr-warmup-iters \(20\) must be smaller than --lr-decay-iters \(9"):
        config.set_train_iters_from_epochs(iterations)


def test_no_length_given_names_the_default(capsys):
    parse_args([*TINY, "--mock-data"])
    assert "note: no --train-iters, --train-samples or --train-epochs: the run is 100 iterations, the default." \
        in capsys.readouterr().out
    parse_args([*TINY, "--mock-data", "--train-iters", "3"])
    assert "note: no --train-iters" not in capsys.readouterr().out


def test_a_decay_that_ends_before_training_is_noted_and_the_lr_is_what_it_says(capsys):
    assert pretrain_gpt.main([*TINY, "--mock-data", "--train-iters", "4", "--lr-decay-iters", "2", "--lr", "1e-3",
                              "--min-lr", "0"]) == 0
    output = capsys.readouterr().out
    assert (" note: the learning rate's decay ends before training does (--lr-decay-iters 2, or a DeepSpeed "
            "scheduler's total_num_steps): iterations 3-4 of 4 train at the learning rate --min-lr 0: those "
            "iterations change no weight.") in output
    # Iterations 1-4 train at 1e-3, 5e-4, 0, 0; each line shows the LR the next iteration uses.
    assert [lr for _, _, lr in _log(output)] == [pytest.approx(5e-4), 0.0, 0.0, 0.0]


def test_a_deepspeed_schedule_shorter_than_the_run_is_noted(tmp_path):
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "scheduler": {
        "type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 30, "warmup_max_lr": 1e-3}}}))

    def summary(train_iters: int) -> str:
        config = parse_args([*TINY, "--mock-data", "--train-iters", str(train_iters), "--deepspeed_config",
                             str(deepspeed)])
        plan = RunPlan(calculator=build_num_microbatches_calculator(config, data_parallel_size=1),
                       train_iters=train_iters, parameters=count_parameters(config), checkpoint=None)
        return format_startup_summary(config, mock_parallel_state(rank=0, world_size=1), plan)

    assert "(--lr-decay-iters 30, or a DeepSpeed scheduler's total_num_steps): iterations 31-40 of 40" in summary(40)
    assert "decay ends before" not in summary(30)
