"""A newcomer's slips with paths and Hugging Face directories get one error that names them: a path that does
not exist says so (not "has no config.json"), the safetensors hint fits the installed transformers, and a
config.json whose vocab_size is smaller than the tokenizer beside it fails at import, not at fine-tuning."""
import importlib.metadata
import json
import os

import pytest

transformers = pytest.importorskip("transformers")

from megatron_lite.interop.hf import checkpoint as hf_checkpoint  # noqa: E402
from megatron_lite.checkpointing.loading import checkpoint_to_load  # noqa: E402
from megatron_lite.checkpointing.storage import CheckpointError, resolve_checkpoint_dir  # noqa: E402
from megatron_lite.config import CheckpointConfig, ConfigError  # noqa: E402
from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

MISSING = "the directory does not exist"


def _gpt2_dir(directory, vocab_size: int) -> str:
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.parametrize("source", ["hf", "megatron", "megatron_lite", "peft"])
def test_the_converter_says_a_load_dir_does_not_exist(tmp_path, capsys, source):
    typo = str(tmp_path / "Llama-3.2-1b")  # the user's directory is Llama-3.2-1B
    extra = ["--base-checkpoint", str(tmp_path)] if source == "peft" else []
    assert convert(["--load-dir", typo, "--save-dir", str(tmp_path / "out"), "--source-format", source,
                    *extra]) == 1
    assert capsys.readouterr().err.strip() == (f"error: --load-dir {typo}: {MISSING}. Check the path (a typo, or "
                                               f"a job that has not written it yet).")


def test_reading_a_missing_hf_directory_or_checkpoint_says_it_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=f"Hugging Face model directory {tmp_path}/nope: {MISSING}"):
        hf_checkpoint.read_hf_directory(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}/nope: {MISSING}"):
        resolve_checkpoint_dir(str(tmp_path / "nope"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match="a_file is a file, not a directory"):
        resolve_checkpoint_dir(str(tmp_path / "a_file"))
    # An existing directory without the file keeps its own message.
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_checkpoint.read_hf_directory(str(tmp_path))


def test_fine_tuning_from_a_missing_directory_says_it_does_not_exist(tmp_path):
    missing = str(tmp_path / "base")
    with pytest.raises(CheckpointError, match=f"--pretrained-checkpoint {missing}: {MISSING}"):
        checkpoint_to_load(CheckpointConfig(pretrained_checkpoint=missing))
    with pytest.raises(CheckpointError, match=f"--finetune needs a checkpoint, but --load {missing}: {MISSING}"):
        checkpoint_to_load(CheckpointConfig(load=missing, finetune=True))
    # A fresh run's --load (the same directory as --save, as Megatron-LM's scripts give it) may not exist yet.
    assert checkpoint_to_load(CheckpointConfig(load=missing)) is None
    with pytest.raises(CheckpointError, match=f"--pretrained-checkpoint {tmp_path} holds no checkpoint"):
        checkpoint_to_load(CheckpointConfig(pretrained_checkpoint=str(tmp_path)))


def test_the_planner_says_an_hf_config_does_not_exist(tmp_path):
    from megatron_lite.plan import parse_plan_args

    with pytest.raises(ConfigError, match="--hf-config .*nope: the file or directory does not exist"):
        parse_plan_args(["--hf-config", str(tmp_path / "nope"), "--num-gpus", "8"])


def _pickled_only(tmp_path) -> str:
    directory = _gpt2_dir(tmp_path / "pickled", 64)
    os.replace(os.path.join(directory, "model.safetensors"), os.path.join(directory, "pytorch_model.bin"))
    return directory


def test_the_safetensors_hint_follows_the_installed_transformers(tmp_path, monkeypatch):
    directory = _pickled_only(tmp_path)
    installed = importlib.metadata.version("transformers")
    with pytest.raises(FileNotFoundError) as refused:
        hf_checkpoint.read_hf_directory(directory)
    message = str(refused.value)
    assert f"call save_pretrained(NEW_DIR) (transformers {installed} writes safetensors)." in message
    if int(installed.split(".")[0]) >= 5:  # transformers 5 has no safe_serialization argument
        assert "safe_serialization" not in message
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.30.2")
    with pytest.raises(FileNotFoundError, match=r"save_pretrained\(NEW_DIR, safe_serialization=True\) "
                                                r"\(transformers 4.30.2 writes pickles by default\)"):
        hf_checkpoint.read_hf_directory(directory)


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    texts = ["the cat sat on the mat", "a dog ran to the park and back", "the end of the story"] * 20
    return save_gpt2_bpe_files(*train_byte_level_bpe(texts, 300, min_frequency=1),
                               str(tmp_path_factory.mktemp("bpe")))


def _with_tokenizer(directory: str, bpe_files) -> str:
    for path, name in zip(bpe_files, ("vocab.json", "merges.txt")):
        with open(path) as source, open(os.path.join(directory, name), "w") as target:
            target.write(source.read())
    return directory


def test_an_hf_vocab_size_below_its_tokenizer_fails_at_import(tmp_path, capsys, bpe_files):
    tokens = len(json.load(open(bpe_files[0])))
    directory = _with_tokenizer(_gpt2_dir(tmp_path / "small", tokens - 10), bpe_files)
    assert convert(["--load-dir", directory, "--save-dir", str(tmp_path / "out"), "--source-format", "hf"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after save_pretrained's progress bar
    assert err.startswith(f"error: {directory}: config.json's vocab_size ({tokens - 10}) is smaller than the "
                          f"tokenizer beside it (vocab.json, merges.txt: {tokens} tokens), so ids {tokens - 10}-"
                          f"{tokens - 1} would have no embedding row.")
    assert not os.path.exists(tmp_path / "out" / "latest_checkpointed_iteration.txt")
    # A vocabulary padded past the tokenizer (the usual case) imports and records the tokenizer.
    directory = _with_tokenizer(_gpt2_dir(tmp_path / "padded", tokens + 20), bpe_files)
    assert convert(["--load-dir", directory, "--save-dir", str(tmp_path / "ok"), "--source-format", "hf"]) == 0
