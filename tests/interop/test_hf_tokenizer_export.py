"""An HF export carries the tokenizer the run was trained with: AutoTokenizer and pipeline() work on it."""
import dataclasses
import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.pretrain_gpt import main as pretrain  # noqa: E402
from megatron_lite.checkpointing import read_config  # noqa: E402
from megatron_lite.tokenizer import build_model_tokenizer, build_tokenizer  # noqa: E402
from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe  # noqa: E402
from megatron_lite.tokenizer.sentencepiece_tokenizer import train_sentencepiece  # noqa: E402
from tools.build_demo_data import demo_documents  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

TEXT = "The for statement iterates over the items of any sequence, in order."
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1", "--mock-data"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    texts = demo_documents()[:200]
    bpe_dir = tmp_path_factory.mktemp("bpe")
    vocab, merges = save_gpt2_bpe_files(*train_byte_level_bpe(texts, 512), str(bpe_dir))
    sentencepiece = train_sentencepiece(texts, str(tmp_path_factory.mktemp("sp") / "tokenizer"), 512)
    return {"GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
            "SentencePieceTokenizer": ["--tokenizer-model", sentencepiece]}


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "SentencePieceTokenizer"])
def test_export_writes_the_recorded_tokenizer(tmp_path, tokenizers, tokenizer_type):
    flags = ["--tokenizer-type", tokenizer_type, *tokenizers[tokenizer_type]]
    assert pretrain([*TINY, *flags, "--save", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    # No tokenizer flags: the export takes the one the checkpoint recorded.
    assert convert(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(out), "--source-format",
                    "megatron_lite", "--target-format", "hf"]) == 0

    ours = build_tokenizer(tokenizer_type, vocab_file=flags[3] if len(flags) > 3 else None,
                           merge_file=flags[5] if len(flags) > 5 else None, tokenizer_model=flags[3])
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    assert theirs(TEXT)["input_ids"] == ours.tokenize(TEXT)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == ours.eod == theirs.eos_token_id
    if tokenizer_type == "SentencePieceTokenizer":  # the model's own pieces, not EOD for every role
        assert (theirs.bos_token, theirs.unk_token, theirs.pad_token) == ("<s>", "<unk>", "<pad>")
        assert config["bos_token_id"] == theirs.bos_token_id == 1 and config["pad_token_id"] == theirs.pad_token_id
    generator = transformers.pipeline("text-generation", model=str(out), device="cpu")
    text = generator(TEXT, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith(TEXT[:20])
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name

    # Imported back, the checkpoint records the directory's tokenizer, so generate needs no tokenizer flags
    # (found on a first day: a round trip lost it, and generate asked for --tokenizer-type).
    assert convert(["--load-dir", str(out), "--save-dir", str(tmp_path / "imported"), "--source-format", "hf",
                    "--target-format", "megatron_lite"]) == 0
    recorded = dataclasses.asdict(read_config(str(tmp_path / "imported")).data)
    assert recorded["tokenizer_type"] == tokenizer_type
    assert build_model_tokenizer(recorded, ours.vocab_size).tokenize(TEXT) == ours.tokenize(TEXT)


def test_export_names_the_flags_when_the_recorded_tokenizer_files_are_gone(tmp_path, tokenizers, capsys):
    vocab, merges = tokenizers["GPT2BPETokenizer"][1], tokenizers["GPT2BPETokenizer"][3]
    moved = tmp_path / "vocab.json"
    moved.write_bytes(open(vocab, "rb").read())
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(moved), "--merge-file", merges]
    assert pretrain([*TINY, *flags, "--save", str(tmp_path / "ckpt")]) == 0
    moved.unlink()
    assert convert(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"),
                    "--target-format", "hf"]) == 1
    assert "pass --tokenizer-type and its files" in capsys.readouterr().err
    assert convert(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"), "--target-format",
                    "hf", *flags[:2], "--vocab-file", vocab, "--merge-file", merges]) == 0
    torch.manual_seed(0)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(TEXT)["input_ids"]


def test_an_export_without_a_tokenizer_says_so_and_claims_no_special_ids(tmp_path, capsys):
    """Found on a first day: a checkpoint naming no tokenizer exported silently, and transformers then took
    GPT-2's default EOD 50256 for a 64-token model (a warning on load, pipeline() failing deep inside)."""
    assert pretrain([*TINY, "--vocab-size", "64", "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert convert(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"), "--source-format",
                    "megatron_lite", "--target-format", "hf"]) == 0
    assert "note: no tokenizer exported (the checkpoint records none)" in capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.config.bos_token_id is None and model.config.eos_token_id is None
    assert not (tmp_path / "hf" / "generation_config.json").exists()
