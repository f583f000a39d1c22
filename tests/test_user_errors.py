"""A user's first day: every failure is one clean `error:` line, early, from one rank, and loses nothing.

Each test runs the command as a user would and checks the exit code, that the message names the problem
and the fix, that it comes early (before the model is built where it can), that there is no traceback of
ours and no copy of the message per rank. Most call the command's ``main(argv)`` in this process (``run``),
or on 2 forked ranks where the ranks matter (``run_command_on_ranks``). What only a real launch shows runs
as real processes: torchrun naming the rank that found an error (``_torchrun``), and Ctrl-C (``_start``).
"""
import importlib
import os
import re
import signal
import subprocess
import sys

import pytest

from megatron_lite import evaluate, pretrain_gpt
from tests.distributed import run_command_on_ranks
from tests.launch.world_group_probe import main_noting_the_world_group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]
MOCK = TINY + ["--vocab-size", "64", "--mock-data"]
OUR_FRAME = re.compile(r'File ".*megatron_lite/')
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture
def run(capsys):
    """``run(args, main=pretrain_gpt.main)``: (exit code, stdout + stderr) of the command in this process."""
    def run_main(args: list[str], main=pretrain_gpt.main):
        capsys.readouterr()
        code = main(args)
        captured = capsys.readouterr()
        return code, captured.out + captured.err
    return run_main


def _on_two_ranks(args: list[str], main=pretrain_gpt.main) -> tuple[list[int], str]:
    """The exit codes of 2 ranks, and their output together."""
    results = run_command_on_ranks(main, args, world_size=2)
    return [code for code, _ in results], "".join(output for _, output in results)


def _command(args: list[str], ranks: int) -> list[str]:
    """pretrain_gpt as a user starts it: under torchrun, or (ranks=1) as a plain process."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    return [sys.executable, *launcher, "-m", "megatron_lite.pretrain_gpt", *args]


def _torchrun(args: list[str], ranks: int = 2, timeout: float = 240):
    """(exit code, stdout + stderr) of pretrain_gpt under a real torchrun."""
    result = subprocess.run(_command(args, ranks), cwd=REPO, env=ENV, capture_output=True, text=True,
                            timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def _assert_one_clean_error(output: str, *fragments: str) -> None:
    errors = _error_lines(output)
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert not OUR_FRAME.search(output), output  # no traceback from our code, on any rank
    assert "usage:" not in output and "failed to" not in output, output


def test_a_mistyped_flag_on_two_ranks_is_one_line_with_the_nearest_flag():
    codes, output = _on_two_ranks([*MOCK, "--num-layer", "2"])
    assert codes == [2, 2]
    _assert_one_clean_error(output, "unrecognized argument --num-layer", "did you mean --num-layers?")


def test_a_mistyped_evaluate_flag_is_one_line_with_the_nearest_flag(run, tmp_path):
    """Found on a first day: megatron_lite.evaluate printed argparse's usage block instead."""
    code, output = run(["--load", str(tmp_path), "--data-path", "x", "--max-sample", "3"], main=evaluate.main)
    assert code == 2
    _assert_one_clean_error(output, "unrecognized argument --max-sample", "did you mean --max-samples?")
    code, output = run(["--data-path", "x"], main=evaluate.main)
    assert code == 2
    _assert_one_clean_error(output, "the following arguments are required: --load")


def test_a_batch_schedule_the_replicas_cannot_split_fails_before_the_model_on_two_ranks():
    codes, output = _on_two_ranks([*MOCK, "--step-batch-size-schedule", "0:1 1K:2", "--train-iters", "2"])
    assert codes == [2, 2]
    _assert_one_clean_error(output, "--step-batch-size-schedule: the global batch 1 (from 0 consumed samples on) "
                                    "must be divisible by --micro-batch-size (1) x data-parallel size (2) = 2")
    assert " model: " not in output


def test_missing_data_under_torchrun_is_reported_once_by_the_rank_that_found_it():
    """The one real torchrun of an error: the reporting rank exits first, the others wait to be stopped."""
    code, output = _torchrun([*TINY, "--vocab-size", "64", "--data-path", "/nonexistent/corpus_text_document"])
    assert code != 0 and "terminate called" not in output, output
    _assert_one_clean_error(output, "--data-path: /nonexistent/corpus_text_document.idx, "
                                    "/nonexistent/corpus_text_document.bin do not exist")
    assert "Root Cause" in output and "rank      : 0" in output.split("Root Cause")[1]  # torchrun blames rank 0


def _write_prefix(prefix: str) -> str:
    from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=__import__("numpy").uint16)
    for _ in range(4):
        builder.add_document(__import__("numpy").arange(40, dtype="uint16") % 60)
    builder.finalize(index_file_path(prefix))
    return prefix


def test_a_missing_data_path_of_a_blend_fails_before_the_model_is_built(run, tmp_path):
    present, absent = _write_prefix(str(tmp_path / "a_text_document")), str(tmp_path / "b_text_document")
    code, output = run([*TINY, "--vocab-size", "64", "--data-path", "0.3", present, "0.7", absent])
    assert code == 2
    _assert_one_clean_error(output, f"--data-path: {absent}.idx, {absent}.bin do not exist",
                            "prefix without .bin/.idx")
    assert present not in _error_lines(output)[0] and " model: " not in output


def test_a_missing_fine_tuning_path_fails_before_the_model_is_built(run, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 2", "response": "3"}\n')
    code, output = run([*TINY, "--vocab-size", "64", "--sft", "--tokenizer-type", "NullTokenizer",
                        "--train-data-path", str(train), "--valid-data-path", str(tmp_path / "valid"),
                        "--test-data-path", str(tmp_path / "test.jsonl")])
    assert code == 2
    _assert_one_clean_error(output, f"--valid-data-path {tmp_path / 'valid'}, --test-data-path "
                                    f"{tmp_path / 'test.jsonl'} do not exist", "PREFIX_text_document.bin/.idx")
    assert str(train) + "," not in output and " model: " not in output


@pytest.mark.parametrize("save", ["/proc/megatron_lite_ckpt", "FILE/ckpt", "FILE"])
def test_an_unwritable_save_fails_before_training(run, tmp_path, save):
    (tmp_path / "FILE").write_text("a regular file")
    save = save.replace("FILE", str(tmp_path / "FILE"))
    code, output = run([*MOCK, "--train-iters", "2", "--save", save])
    assert code == 2
    _assert_one_clean_error(output, f"--save {save}")
    assert "iteration" not in output  # failed before the first step, not at the first save
    assert (tmp_path / "FILE").read_text() == "a regular file"  # nothing already written is lost


def test_a_save_that_cannot_hold_a_checkpoint_fails_before_training():
    from megatron_lite.checkpointing.preflight import check_save_dir
    from megatron_lite.checkpointing.storage import CheckpointError

    with pytest.raises(CheckpointError, match="GiB free, but one checkpoint of this model needs"):
        check_save_dir(REPO, needed_bytes=2**60)


def test_finetune_from_a_missing_checkpoint_is_an_error(run, tmp_path):
    missing = str(tmp_path / "no_such_ckpt")
    code, output = run([*MOCK, "--train-iters", "1", "--load", missing, "--finetune"])
    assert code == 2
    _assert_one_clean_error(output, f"--load {missing}: the directory does not exist", "--finetune")


def test_load_without_a_checkpoint_starts_from_scratch_and_says_so(run, tmp_path):
    code, output = run([*MOCK, "--train-iters", "1", "--load", str(tmp_path / "empty")])
    assert code == 0, output
    assert "TRAINING STARTS FROM RANDOM WEIGHTS" in output


def test_missing_tokenizer_files_name_the_tokenizer_flags(run):
    code, output = run([*TINY, "--mock-data", "--tokenizer-type", "GPT2BPETokenizer"])
    assert code == 2
    _assert_one_clean_error(output, "GPT2BPETokenizer needs --vocab-file", "--merge-file")
    code, output = run([*TINY, "--mock-data"])
    assert code == 2
    _assert_one_clean_error(output, "--tokenizer-type")


def _start(args: list[str], ranks: int):
    return subprocess.Popen(_command(args, ranks), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _interrupt_after_first_iteration(process) -> str:
    """Ctrl-C as a terminal sends it: SIGINT to every process of the job, once training runs."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if " iteration " in line:
            os.killpg(process.pid, signal.SIGINT)
            break
    lines.extend(process.stdout)
    process.wait(timeout=120)
    return "".join(lines)


def test_ctrl_c_prints_one_line_not_a_traceback_per_rank():
    process = _start([*MOCK, "--train-iters", "100000"], ranks=2)
    output = _interrupt_after_first_iteration(process)
    assert output.count("interrupted (Ctrl-C)") == 1, output
    assert "KeyboardInterrupt" not in output and not OUR_FRAME.search(output), output


def test_ctrl_c_with_exit_signal_handler_saves_like_sigterm(tmp_path):
    """One process: the ranks agreeing on a signal is test_signal_handler's, a whole torchrun job saving on one
    (SIGTERM) tests/launch/test_slurm_e2e's; here Ctrl-C is what stops the run, and it saves."""
    save = tmp_path / "ckpt"
    process = _start([*MOCK, "--train-iters", "100000", "--exit-signal-handler", "--save", str(save)], ranks=1)
    output = _interrupt_after_first_iteration(process)
    assert process.returncode == 0, output
    assert "exiting at iteration" in output and (save / "latest_checkpointed_iteration.txt").exists(), output
    assert "KeyboardInterrupt" not in output and not OUR_FRAME.search(output), output


def test_extending_a_run_names_the_scheduler_flags_and_they_work(run, tmp_path):
    save = str(tmp_path / "ckpt")
    code, output = run([*MOCK, "--train-iters", "2", "--lr", "1e-3", "--save", save])
    assert code == 0, output
    extend = [*MOCK, "--train-iters", "4", "--lr", "1e-3", "--load", save, "--save", save]
    # On 2 ranks: the resume fails once the model and its process groups exist. The failing resume used to abort
    # with SIGABRT about 1 run in 3 at interpreter shutdown; its cause, a WORLD group outliving the teardown, is
    # checked directly (as test_clean_exit does for a finished run).
    codes, output = _on_two_ranks(extend, main=main_noting_the_world_group)
    assert codes == [2, 2] and output.count("WORLD group freed after teardown: True") == 2, output
    # The schedule counts samples: 2 iterations of 1 then, 4 iterations of 2 (one per rank) now.
    _assert_one_clean_error(output, "--lr-decay-iters/--lr-decay-samples (checkpoint 2 samples, this run 8 "
                            "samples)", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    code, output = run([*extend, "--override-opt_param-scheduler"])
    assert code == 0 and "iteration        4/       4" in output, output
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "4"


def test_an_empty_train_split_fails_at_start_up_and_an_empty_validation_split_is_a_notice(run, tmp_path):
    from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=__import__("numpy").uint16)
    for document in range(4):
        builder.add_document(__import__("numpy").arange(40, dtype="uint16") % 60)
    builder.finalize(index_file_path(prefix))
    data = [*TINY, "--vocab-size", "64", "--data-path", prefix, "--train-iters", "1", "--eval-interval", "1"]
    code, output = run([*data, "--split", "0,100,0"])
    assert code == 2
    _assert_one_clean_error(output, "no training data: --split 0,100,0 gives the train split no documents")
    code, output = run([*data, "--split", "100,0,0"])
    assert code == 0, output
    assert "notice: no validation data (--split 100,0,0" in output and " model: " in output


def test_a_failing_save_is_one_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    import errno

    from megatron_lite.checkpointing import storage
    from megatron_lite.pretrain_gpt import main

    save = str(tmp_path / "ckpt")
    assert main([*MOCK, "--train-iters", "1", "--save", save]) == 0

    def disk_full(path, tensors):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(storage, "write_tensor_file", disk_full)
    capsys.readouterr()
    assert main([*MOCK, "--train-iters", "2", "--load", save, "--save", save, "--override-opt_param-scheduler"]) == 2
    err = capsys.readouterr().err
    _assert_one_clean_error(err, f"could not write the checkpoint to --save {save}: No space left on device",
                            "The previous checkpoint is untouched")
    assert storage.read_latest_iteration(save) == 1


def test_load_of_one_iteration_directory_names_its_parent_instead_of_training_from_scratch(run, tmp_path):
    """Found on a first day: --load ckpt/iter_0000001 (a plausible slip) only warned, then trained from random
    weights; generate said the directory held no checkpoint."""
    code, output = run([*MOCK, "--train-iters", "1", "--save", str(tmp_path)])
    assert code == 0, output
    iteration_dir = str(tmp_path / "iter_0000001")
    code, output = run([*MOCK, "--train-iters", "2", "--load", iteration_dir])
    assert code != 0
    _assert_one_clean_error(output, f"{iteration_dir} is one iteration's checkpoint directory",
                            f"give its parent {tmp_path} instead")
    assert " model: " not in output and "RANDOM WEIGHTS" not in output


@pytest.mark.parametrize("tokenizer_flags, fragments", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "MERGES", "--merge-file", "VOCAB"],
     ["--vocab-file", "is not a JSON vocabulary", "swapped"]),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "VOCAB"],
     ["--tokenizer-model", "is not a SentencePiece model"]),
], ids=["swapped-bpe-files", "vocab-json-as-sentencepiece"])
def test_a_tokenizer_file_of_the_wrong_kind_is_one_error(run, tmp_path, tokenizer_flags, fragments):
    """Found on a first day: swapped --vocab-file/--merge-file, or a vocab.json given to SentencePiece, ended
    in a JSONDecodeError / RuntimeError traceback."""
    (tmp_path / "vocab.json").write_text('{"a": 0, "<|endoftext|>": 1}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    flags = [f.replace("VOCAB", str(tmp_path / "vocab.json")).replace("MERGES", str(tmp_path / "merges.txt"))
             for f in tokenizer_flags]
    code, output = run([*TINY, "--mock-data", "--train-iters", "1", *flags])
    assert code != 0
    _assert_one_clean_error(output, *fragments)
    assert "Traceback" not in output


@pytest.mark.parametrize("tool, args, nearest", [
    ("print_rank_map", ["--nnode", "1", "--nproc-per-node", "2"], "--nnodes"),
    ("print_pipeline_schedule", ["--pipeline-model-parallel-size", "2", "--num-microbatches", "4", "--op"], "--ops"),
    ("build_demo_data", ["--output-dirs", "demo"], "--output-dir"),
    ("build_sft_demo_data", ["--output-dir", "demo", "--train-example", "3"], "--train-examples"),
    ("merge_datasets", ["--input", "a", "--output-prefixes", "b"], "--output-prefix"),
    ("loss_parity", ["--layouts", "1x1x1", "--rtl", "1e-3", "--", "--mock-data"], "--rtol"),
])
def test_a_mistyped_tool_flag_is_one_line_with_the_nearest_flag(run, tool, args, nearest, tmp_path, monkeypatch):
    """(megatron_lite.evaluate has its own test above.)"""
    monkeypatch.chdir(tmp_path)
    code, output = run(args, main=importlib.import_module(f"tools.{tool}").main)
    assert code == 2, output
    _assert_one_clean_error(output, f"did you mean {nearest}?")
    assert not os.listdir(tmp_path)  # it stopped before doing anything
