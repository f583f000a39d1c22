"""Our Megatron-LM legacy export (--target-format megatron --megatron-ckpt-format torch): its files are laid out
as Megatron-LM's own (the committed fixtures of tools/make_megatron_fixtures.py), and it imports back exactly."""
import dataclasses
import os

import pytest
import torch

from megatron_lite.checkpointing.megatron.args_mapping import megatron_args_from_config
from megatron_lite.checkpointing.megatron.importer import read_megatron_checkpoint
from megatron_lite.checkpointing.megatron.legacy import rank_files, read_rank_file
from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir
from megatron_lite.config import ConfigError
from tests.checkpointing.test_megatron_import import fixture, megatron_logits, our_logits
from tools.checkpoint_convert import main as convert


def _imported(name: str, tmp_path) -> str:
    root = str(tmp_path / "ours")
    assert convert(["--source-format", "megatron", "--load-dir", fixture(name), "--save-dir", root]) == 0
    return root


def _exported(root: str, save_dir: str, tp: int, pp: int) -> str:
    assert convert(["--target-format", "megatron", "--megatron-ckpt-format", "torch", "--load-dir", root,
                    "--save-dir", save_dir, "--target-tensor-parallel-size", str(tp),
                    "--target-pipeline-parallel-size", str(pp)]) == 0
    return save_dir


def _layout(model: dict) -> dict:
    return {name: None if t is None else (tuple(t.shape), t.dtype) for name, t in model.items()}


@pytest.mark.parametrize("name", ["gpt2_tp2pp2_torch", "llama_tp2pp2_torch"])
def test_export_writes_megatrons_files(name, tmp_path):
    """Imported from Megatron-LM's tp2 x pp2 files and exported at tp2 x pp2: every rank file has Megatron's
    names, shapes and dtypes (their ``_extra_state`` entries included), and the very same values."""
    exported = _exported(_imported(name, tmp_path), str(tmp_path / "megatron"), 2, 2)
    theirs = rank_files(os.path.join(fixture(name), "iter_0000010"))
    ours = rank_files(os.path.join(exported, "iter_0000010"))
    assert sorted(ours) == sorted(theirs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, path in theirs.items():
        their_file, our_file = read_rank_file(path), read_rank_file(ours[rank])
        assert _layout(our_file["model"]) == _layout(their_file["model"]), rank
        for key, tensor in their_file["model"].items():
            if tensor is not None:
                assert torch.equal(our_file["model"][key], tensor), (rank, key)
        assert (our_file["iteration"], our_file["checkpoint_version"]) == (10, 3.0)
        for arg in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                    "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "swiglu",
                    "normalization", "position_embedding_type", "add_bias_linear",
                    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "kv_channels"):
            assert getattr(our_file["args"], arg) == getattr(their_file["args"], arg), arg
    with open(os.path.join(exported, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "10"


@pytest.mark.parametrize("name,tp,pp", [("gpt2_tp2pp2_torch", 1, 1), ("llama_tp1pp1_torch", 2, 2),
                                        ("gpt2_tp1pp1_torch", 2, 2)])
def test_export_then_import_round_trips(name, tp, pp, tmp_path):
    """Ours -> Megatron-LM at (tp, pp) -> ours: the same weights (the vocabulary padded for tp with zero rows),
    and the same logits, Megatron's own."""
    root = _imported(name, tmp_path)
    back = read_megatron_checkpoint(_exported(root, str(tmp_path / "megatron"), tp, pp))
    reader = CheckpointReader(resolve_checkpoint_dir(root))
    before = {key: reader.read(key) for key in reader.tensors}
    assert set(back.tensors) == set(before)
    for key, tensor in before.items():
        rows = tensor.shape[0]
        assert torch.equal(back.tensors[key][:rows], tensor), key
        assert not back.tensors[key][rows:].any(), key
    tokens, reference = megatron_logits(name)
    reimported = str(tmp_path / "again")
    assert convert(["--source-format", "megatron", "--load-dir", str(tmp_path / "megatron"),
                    "--save-dir", reimported]) == 0
    logits, before_logits = our_logits(reimported, tokens), our_logits(root, tokens)
    torch.testing.assert_close(logits[..., :before_logits.shape[-1]], before_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[..., :reference.shape[-1]], reference, atol=1e-5, rtol=0)


def test_a_model_megatron_cannot_rebuild_is_refused_by_flag():
    config = read_megatron_checkpoint(fixture("llama_tp1pp1_torch")).config
    windowed = dataclasses.replace(config, model=dataclasses.replace(config.model, window_size=(4, 0)))
    with pytest.raises(ConfigError, match="--window-size"):
        megatron_args_from_config(windowed, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  iteration=0, source="ckpt")
