"""A user's first day: every failure is one clean `error:` line, early, from one rank, and loses nothing.

Each test runs the command as a user would (the CLI, under torchrun with 2 ranks where the
ranks matter) and checks the exit code, the time to fail, that the message names the problem
and the fix, that there is no traceback of ours and no copy of the message per rank.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]
MOCK = TINY + ["--vocab-size", "64", "--mock-data"]
OUR_FRAME = re.compile(r'File ".*megatron_lite/')


def _run(args: list[str], *, ranks: int = 1, timeout: float = 120, module: str = "megatron_lite.pretrain_gpt"):
    """(exit code, stdout + stderr, seconds) of ``module`` (pretrain_gpt) run as a user would."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks > 1
                else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    result = subprocess.run([*launcher, "-m", module, *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr, time.perf_counter() - start


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def _assert_one_clean_error(output: str, *fragments: str) -> None:
    errors = _error_lines(output)
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert not OUR_FRAME.search(output), output  # no traceback from our code, on any rank
    assert "usage:" not in output and "failed to" not in output, output


def test_a_mistyped_flag_under_torchrun_is_one_line_with_the_nearest_flag():
    code, output, seconds = _run([*MOCK, "--num-layer", "2"], ranks=2)
    assert code != 0
    _assert_one_clean_error(output, "unrecognized argument --num-layer", "did you mean --num-layers?")
    assert seconds < 60


def test_a_mistyped_evaluate_flag_is_one_line_with_the_nearest_flag(tmp_path):
    """Found on a first day: megatron_lite.evaluate printed argparse's usage block instead."""
    code, output, _ = _run(["--load", str(tmp_path), "--data-path", "x", "--max-sample", "3"],
                           module="megatron_lite.evaluate")
    assert code == 2
    _assert_one_clean_error(output, "unrecognized argument --max-sample", "did you mean --max-samples?")
    code, output, _ = _run(["--data-path", "x"], module="megatron_lite.evaluate")
    assert code == 2
    _assert_one_clean_error(output, "the following arguments are required: --load")


def test_a_batch_schedule_the_replicas_cannot_split_fails_before_the_model_under_torchrun():
    code, output, seconds = _run([*MOCK, "--step-batch-size-schedule", "0:1 1K:2", "--train-iters", "2"], ranks=2)
    assert code != 0
    _assert_one_clean_error(output, "--step-batch-size-schedule: the global batch 1 (from 0 consumed samples on) "
                                    "must be divisible by --micro-batch-size (1) x data-parallel size (2) = 2")
    assert " model: " not in output and seconds < 60


def test_missing_data_under_torchrun_is_reported_once_by_the_rank_that_found_it():
    code, output, _ = _run([*TINY, "--vocab-size", "64", "--data-path", "/nonexistent/corpus_text_document"],
                           ranks=2)
    assert code != 0
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


def test_a_missing_data_path_of_a_blend_fails_before_the_model_is_built(tmp_path):
    present, absent = _write_prefix(str(tmp_path / "a_text_document")), str(tmp_path / "b_text_document")
    code, output, _ = _run([*TINY, "--vocab-size", "64", "--data-path", "0.3", present, "0.7", absent])
    assert code == 2
    _assert_one_clean_error(output, f"--data-path: {absent}.idx, {absent}.bin do not exist",
                            "prefix without .bin/.idx")
    assert present not in _error_lines(output)[0] and " model: " not in output


def test_a_missing_fine_tuning_path_fails_before_the_model_is_built(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 2", "response": "3"}\n')
    code, output, _ = _run([*TINY, "--vocab-size", "64", "--sft", "--tokenizer-type", "NullTokenizer",
                            "--train-data-path", str(train), "--valid-data-path", str(tmp_path / "valid"),
                            "--test-data-path", str(tmp_path / "test.jsonl")])
    assert code == 2
    _assert_one_clean_error(output, f"--valid-data-path {tmp_path / 'valid'}, --test-data-path "
                                    f"{tmp_path / 'test.jsonl'} do not exist", "PREFIX_text_document.bin/.idx")
    assert str(train) + "," not in output and " model: " not in output


@pytest.mark.parametrize("save", ["/proc/megatron_lite_ckpt", "FILE/ckpt", "FILE"])
def test_an_unwritable_save_fails_before_training(tmp_path, save):
    (tmp_path / "FILE").write_text("a regular file")
    save = save.replace("FILE", str(tmp_path / "FILE"))
    code, output, seconds = _run([*MOCK, "--train-iters", "2", "--save", save])
    assert code == 2
    _assert_one_clean_error(output, f"--save {save}")
    assert "iteration" not in output  # failed before the first step, not at the first save
    assert (tmp_path / "FILE").read_text() == "a regular file"  # nothing already written is lost


def test_a_save_that_cannot_hold_a_checkpoint_fails_before_training():
    from megatron_lite.checkpointing.preflight import check_save_dir
    from megatron_lite.checkpointing.storage import CheckpointError

    with pytest.raises(CheckpointError, match="GiB free, but one checkpoint of this model needs"):
        check_save_dir(REPO, needed_bytes=2**60)


def test_finetune_from_a_missing_checkpoint_is_an_error(tmp_path):
    missing = str(tmp_path / "no_such_ckpt")
    code, output, _ = _run([*MOCK, "--train-iters", "1", "--load", missing, "--finetune"])
    assert code == 2
    _assert_one_clean_error(output, f"--load {missing} holds none", "--finetune")


def test_load_without_a_checkpoint_starts_from_scratch_and_says_so(tmp_path):
    code, output, _ = _run([*MOCK, "--train-iters", "1", "--load", str(tmp_path / "empty")])
    assert code == 0, output
    assert "TRAINING STARTS FROM RANDOM WEIGHTS" in output


def test_missing_tokenizer_files_name_the_tokenizer_flags():
    code, output, _ = _run([*TINY, "--mock-data", "--tokenizer-type", "GPT2BPETokenizer"])
    assert code == 2
    _assert_one_clean_error(output, "GPT2BPETokenizer needs --vocab-file", "--merge-file")
    code, output, _ = _run([*TINY, "--mock-data"])
    assert code == 2
    _assert_one_clean_error(output, "--tokenizer-type")


def _start(args: list[str], ranks: int):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m",
                             "megatron_lite.pretrain_gpt", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
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
    save = tmp_path / "ckpt"
    process = _start([*MOCK, "--train-iters", "100000", "--exit-signal-handler", "--save", str(save)], ranks=2)
    output = _interrupt_after_first_iteration(process)
    # torchrun itself exits 1 on SIGINT whatever its workers do; the workers save and leave.
    assert "exiting at iteration" in output and (save / "latest_checkpointed_iteration.txt").exists(), output
    assert "KeyboardInterrupt" not in output and not OUR_FRAME.search(output), output


def test_extending_a_run_names_the_scheduler_flags_and_they_work(tmp_path):
    save = str(tmp_path / "ckpt")
    code, output, _ = _run([*MOCK, "--train-iters", "2", "--lr", "1e-3", "--save", save])
    assert code == 0, output
    extend = [*MOCK, "--train-iters", "4", "--lr", "1e-3", "--load", save, "--save", save]
    for attempt in range(2):  # the failing resume used to abort with SIGABRT about 1 run in 3
        code, output, _ = _run(extend, ranks=2)
        assert code == 1 and "terminate called" not in output and "exitcode  : -6" not in output, output
        # The schedule counts samples: 2 iterations of 1 then, 4 iterations of 2 (one per rank) now.
        _assert_one_clean_error(output, "--lr-decay-iters/--lr-decay-samples (checkpoint 2 samples, this run 8 "
                                "samples)", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    code, output, _ = _run([*extend, "--override-opt_param-scheduler"])
    assert code == 0 and "iteration        4/       4" in output, output
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "4"


def test_an_empty_train_split_fails_at_start_up_and_an_empty_validation_split_is_a_notice(tmp_path):
    from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=__import__("numpy").uint16)
    for document in range(4):
        builder.add_document(__import__("numpy").arange(40, dtype="uint16") % 60)
    builder.finalize(index_file_path(prefix))
    data = [*TINY, "--vocab-size", "64", "--data-path", prefix, "--train-iters", "1", "--eval-interval", "1"]
    code, output, _ = _run([*data, "--split", "0,100,0"])
    assert code == 2
    _assert_one_clean_error(output, "no training data: --split 0,100,0 gives the train split no documents")
    code, output, _ = _run([*data, "--split", "100,0,0"])
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


def test_load_of_one_iteration_directory_names_its_parent_instead_of_training_from_scratch(tmp_path):
    """Found on a first day: --load ckpt/iter_0000001 (a plausible slip) only warned, then trained from random
    weights; generate said the directory held no checkpoint."""
    code, output, _ = _run([*MOCK, "--train-iters", "1", "--save", str(tmp_path)])
    assert code == 0, output
    iteration_dir = str(tmp_path / "iter_0000001")
    code, output, seconds = _run([*MOCK, "--train-iters", "2", "--load", iteration_dir])
    assert code != 0
    _assert_one_clean_error(output, f"{iteration_dir} is one iteration's checkpoint directory",
                            f"give its parent {tmp_path} instead")
    assert " model: " not in output and "RANDOM WEIGHTS" not in output and seconds < 60


@pytest.mark.parametrize("tokenizer_flags, fragments", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "MERGES", "--merge-file", "VOCAB"],
     ["--vocab-file", "is not a JSON vocabulary", "swapped"]),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "VOCAB"],
     ["--tokenizer-model", "is not a SentencePiece model"]),
], ids=["swapped-bpe-files", "vocab-json-as-sentencepiece"])
def test_a_tokenizer_file_of_the_wrong_kind_is_one_error(tmp_path, tokenizer_flags, fragments):
    """Found on a first day: swapped --vocab-file/--merge-file, or a vocab.json given to SentencePiece, ended
    in a JSONDecodeError / RuntimeError traceback."""
    (tmp_path / "vocab.json").write_text('{"a": 0, "<|endoftext|>": 1}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    flags = [f.replace("VOCAB", str(tmp_path / "vocab.json")).replace("MERGES", str(tmp_path / "merges.txt"))
             for f in tokenizer_flags]
    code, output, _ = _run([*TINY, "--mock-data", "--train-iters", "1", *flags])
    assert code != 0
    _assert_one_clean_error(output, *fragments)
    assert "Traceback" not in output


def _tool(name: str) -> str:
    return os.path.join(REPO, "tools", f"{name}.py")


@pytest.mark.parametrize("command, nearest", [
    ([_tool("print_rank_map"), "--nnode", "1", "--nproc-per-node", "2"], "--nnodes"),
    ([_tool("print_pipeline_schedule"), "--pipeline-model-parallel-size", "2", "--num-microbatches", "4", "--op"],
     "--ops"),
    ([_tool("build_demo_data"), "--output-dirs", "demo"], "--output-dir"),
    ([_tool("build_sft_demo_data"), "--output-dir", "demo", "--train-example", "3"], "--train-examples"),
    ([_tool("merge_datasets"), "--input", "a", "--output-prefixes", "b"], "--output-prefix"),
    ([_tool("loss_parity"), "--layouts", "1x1x1", "--rtl", "1e-3", "--", "--mock-data"], "--rtol"),
])
def test_a_mistyped_tool_flag_is_one_line_with_the_nearest_flag(command, nearest, tmp_path):
    """(megatron_lite.evaluate has its own test above.)"""
    result = subprocess.run([sys.executable, *command], cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    _assert_one_clean_error(result.stdout + result.stderr, f"did you mean {nearest}?")
    assert not os.listdir(tmp_path)  # it stopped before doing anything
