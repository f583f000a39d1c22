"""Our Megatron-LM exports (--target-format megatron, --megatron-ckpt-format torch or torch_dist): their files are
laid out as Megatron-LM's own (the committed fixtures of tools/make_megatron_fixtures.py), and they import back
exactly."""
import dataclasses
import io
import json
import os

import pytest
import torch
from torch.distributed.checkpoint import metadata

from megatron_lite.interop.megatron import torch_dist
from megatron_lite.interop.megatron.args_mapping import megatron_args_from_config
from megatron_lite.interop.megatron.importer import read_megatron_checkpoint
from megatron_lite.interop.megatron.legacy import rank_files, read_rank_file
from megatron_lite.checkpointing.resharding import CheckpointReader
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir
from megatron_lite.config import ConfigError
from tests.interop.test_megatron_import import (assert_megatrons_outputs, fixture, megatron_outputs,
                                                our_outputs)
from tools.checkpoint_convert import main as convert


def _imported(name: str, tmp_path, tp: int = 1, pp: int = 1) -> str:
    """The fixture as our checkpoint at our layout (tp, pp)."""
    root = str(tmp_path / "ours")
    assert convert(["--source-format", "megatron", "--load-dir", fixture(name), "--save-dir", root,
                    "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]) == 0
    return root


def _exported(root: str, save_dir: str, tp: int, pp: int, ckpt_format: str = "torch", *extra) -> str:
    assert convert(["--target-format", "megatron", "--megatron-ckpt-format", ckpt_format, "--load-dir", root,
                    "--save-dir", save_dir, "--target-tensor-parallel-size", str(tp),
                    "--target-pipeline-parallel-size", str(pp), *extra]) == 0
    return save_dir


def _layout(model: dict) -> dict:
    return {name: None if t is None else (tuple(t.shape), t.dtype) for name, t in model.items()}


ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "swiglu",
                     "normalization", "position_embedding_type", "add_bias_linear", "bf16",
                     "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "kv_channels")


# The Qwen/Mistral/Llama 3.1 features' args (llama_variants_*).
VARIANT_ARGS = ("qk_layernorm", "add_qkv_bias", "window_size", "window_attn_skip_freq", "use_rope_scaling",
                "rope_scaling_factor", "rotary_base")
MOE_ARGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_score_function",
            "expert_model_parallel_size", "moe_grouped_gemm")


@pytest.mark.parametrize("name,tp,pp,ep", [("gpt2_tp2pp2_torch", 2, 2, 1), ("llama_tp1pp1_torch_bf16", 1, 1, 1),
                                           ("moe_tp2pp1ep2_torch", 2, 1, 2), ("moe_expert_bias_tp1pp1_torch", 1, 1, 1),
                                           ("llama_variants_tp2pp1_torch", 2, 1, 1),
                                           ("mtp_tp2pp2_torch", 2, 2, 1), ("qwen_attention_tp2pp1_torch", 2, 1, 1)])
def test_legacy_export_writes_megatrons_files(name, tp, pp, ep, tmp_path):
    """Imported from Megatron-LM's files and exported at their layout: every rank file has Megatron's names,
    shapes and dtypes (bf16 stays bf16; the ``_extra_state`` entries and the tied embeddings' last-stage copy
    included; each expert-parallel rank's experts numbered from 0; multi-token prediction's layers and the
    last stage's copy of the embedding), and the very same values, but for the output layer weight that
    Megatron's last stage with tied embeddings and multi-token prediction holds and never reads (ours: the
    embedding)."""
    exported = _exported(_imported(name, tmp_path), str(tmp_path / "megatron"), tp, pp, "torch",
                         "--target-expert-parallel-size", str(ep))
    theirs = rank_files(os.path.join(fixture(name), "iter_0000010"))
    ours = rank_files(os.path.join(exported, "iter_0000010"))
    assert sorted(ours) == sorted(theirs) == [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)]
    for rank, path in theirs.items():
        their_file, our_file = read_rank_file(path), read_rank_file(ours[rank])
        assert _layout(our_file["model"]) == _layout(their_file["model"]), rank
        unread = "output_layer.weight" if "mtp.layers.0.enorm.weight" in their_file["model"] and not getattr(
            their_file["args"], "untie_embeddings_and_output_weights", False) else None
        for key, tensor in their_file["model"].items():
            if tensor is not None and key != unread:
                assert torch.equal(our_file["model"][key], tensor), (rank, key)
        assert (our_file["iteration"], our_file["checkpoint_version"]) == (10, 3.0)
        for arg in ARCHITECTURE_ARGS + (MOE_ARGS if ep > 1 else ()) + (VARIANT_ARGS if "variants" in name else ()):
            assert getattr(our_file["args"], arg) == getattr(their_file["args"], arg), arg
    with open(os.path.join(exported, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "10"


def _torch_dist_files(directory: str) -> dict:
    """{key: (global shape, dtype, {chunk offsets: (sizes, file, value)})} or {key: ("bytes", file, object)} of
    a torch_dist directory, read as Megatron-LM's loader (torch.distributed.checkpoint) reads it."""
    meta = torch_dist.read_metadata(directory)

    def item(info):
        with open(os.path.join(directory, info.relative_path), "rb") as f:
            f.seek(info.offset)
            return torch.load(io.BytesIO(f.read(info.length)), weights_only=False, map_location="cpu")

    files = {}
    for key, entry in meta.state_dict_metadata.items():
        if isinstance(entry, metadata.BytesStorageMetadata):
            info = meta.storage_data[metadata.MetadataIndex(key)]
            files[key] = ("bytes", info.relative_path, None if key.startswith("common_state") else item(info))
            continue
        chunks = {}
        for chunk in entry.chunks:
            info = meta.storage_data[metadata.MetadataIndex(key, chunk.offsets)]
            chunks[tuple(chunk.offsets)] = (tuple(chunk.sizes), info.relative_path, item(info))
        files[key] = (tuple(entry.size), entry.properties.dtype, chunks)
    return files


def _files(directory: str) -> list:
    return sorted(f for f in os.listdir(directory) if os.path.isfile(os.path.join(directory, f)))


@pytest.mark.parametrize("name,common_state,our_layout", [("gpt2_tp2pp1_torch_dist", "common.pt", (2, 2)),
                                                          ("llama_tp2pp1_torch_dist_core020", "distcp", (1, 1)),
                                                          ("llama_variants_tp2pp1_torch_dist", "common.pt", (1, 1))])
def test_torch_dist_export_writes_megatrons_files(name, common_state, our_layout, tmp_path):
    """Imported from Megatron-Core's torch_dist files (core 0.17: common.pt; main: the common state inside the
    .distcp) into our checkpoint at ``our_layout``, and exported as torch_dist at their layout: the same keys
    (layers stacked, Transformer Engine's norm names, ``_extra_state`` objects), global shapes, dtypes, chunks,
    the same rank's file holding each chunk, the very same values, metadata.json and common state."""
    exported = _exported(_imported(name, tmp_path, *our_layout), str(tmp_path / "megatron"), 2, 1, "torch_dist",
                         "--megatron-common-state", common_state)
    theirs, ours = (os.path.join(root, "iter_0000010") for root in (fixture(name), exported))
    their_files, our_files = _torch_dist_files(theirs), _torch_dist_files(ours)
    assert sorted(our_files) == sorted(their_files)
    for key, (shape, dtype, chunks) in their_files.items():
        our_shape, our_dtype, our_chunks = our_files[key]
        assert (our_shape, our_dtype) == (shape, dtype), key  # bytes: the file holding them
        if shape == "bytes":
            assert our_chunks == chunks, key  # _extra_state: None in both
            continue
        assert sorted(our_chunks) == sorted(chunks), key
        for offsets, (sizes, file, value) in chunks.items():
            assert our_chunks[offsets][:2] == (sizes, file), (key, offsets)
            assert torch.equal(our_chunks[offsets][2], value), (key, offsets)
    assert _files(ours) == _files(theirs)
    for directory in (theirs, ours):
        with open(os.path.join(directory, "metadata.json")) as f:
            assert json.load(f) == json.load(open(os.path.join(theirs, "metadata.json")))
    their_common, our_common = (torch_dist.read_common_state(d) for d in (theirs, ours))
    assert sorted(our_common) == sorted(their_common)
    for key in ("checkpoint_version", "iteration", "num_floating_point_operations_so_far", "content_metadata"):
        assert our_common[key] == their_common[key], key
    for arg in ARCHITECTURE_ARGS + (VARIANT_ARGS if "variants" in name else ()):
        assert getattr(our_common["args"], arg) == getattr(their_common["args"], arg), arg
    assert our_common["args"].ckpt_format == "torch_dist"


@pytest.mark.parametrize("name,tp,common_state", [("moe_tp2pp1ep2_torch_dist", 2, "common.pt"),
                                                  ("mtp_moe_tp1pp1ep2_torch_dist", 1, "common.pt"),
                                                  ("gpt_oss_tp2pp1etp1ep2_torch_dist_core020", 2, "distcp"),
                                                  ("moe_glm_tp2pp1ep2_torch_dist", 2, "common.pt")])
def test_torch_dist_moe_export_writes_megatrons_chunks(name, tp, common_state, tmp_path):
    """A mixture of experts in torch_dist (tp2 x ep2; with a multi-token prediction layer, whose tensors are
    each their own key, its experts [experts, ...], at tp1 x ep2; gpt-oss's, a dense layer and then experts
    with biases, a key per layer, the experts whole on each rank under tp2, written by main), imported and
    exported at its layout: the same keys (the experts' [layers, experts, ...] and their ``_extra_state``
    objects per layer and expert), global shapes, dtypes, chunks and values, each expert's chunks in its
    (tensor, expert) rank's file where they are split over the tensor ranks. Megatron spreads the writing of
    replicated tensors (whole experts too) over the data-parallel ranks; our export writes them from expert
    rank 0 (its experts' from their expert rank's tensor rank 0). GLM-4.5's adds the expert bias, a gated
    shared expert and query/key norms."""
    exported = _exported(_imported(name, tmp_path), str(tmp_path / "megatron"), tp, 1, "torch_dist",
                         "--target-expert-parallel-size", "2", "--megatron-common-state", common_state)
    theirs, ours = (_torch_dist_files(os.path.join(root, "iter_0000010")) for root in (fixture(name), exported))
    assert sorted(ours) == sorted(theirs)
    for key, (shape, dtype, chunks) in theirs.items():
        our_shape, our_dtype, our_chunks = ours[key]
        assert (our_shape, our_dtype) == (shape, dtype) or shape == "bytes", key
        if shape == "bytes":
            assert our_chunks == chunks, key
            continue
        assert sorted(our_chunks) == sorted(chunks), key
        for offsets, (sizes, file, value) in chunks.items():
            assert our_chunks[offsets][0] == sizes and torch.equal(our_chunks[offsets][2], value), (key, offsets)
            if ".experts.experts." in key and "etp1" not in name:
                assert our_chunks[offsets][1] == file, (key, offsets)


def test_a_bf16_checkpoint_stays_bf16_through_torch_dist(tmp_path):
    """Megatron's bf16 checkpoint, imported and exported as torch_dist at another layout: bf16 tensors, the
    very weights (the export's args say --bf16 too)."""
    name = "llama_tp1pp1_torch_bf16"
    exported = _exported(_imported(name, tmp_path), str(tmp_path / "megatron"), 2, 2, "torch_dist")
    files = _torch_dist_files(os.path.join(exported, "iter_0000010"))
    assert {entry[1] for entry in files.values() if entry[0] != "bytes"} == {torch.bfloat16}
    back, source = read_megatron_checkpoint(exported), read_megatron_checkpoint(fixture(name))
    assert back.config.training.bf16 and sorted(back.tensors) == sorted(source.tensors)
    for key, tensor in source.tensors.items():
        assert back.tensors[key].dtype == torch.bfloat16 and torch.equal(back.tensors[key], tensor), key


@pytest.mark.parametrize("name,ckpt_format,tp,pp,ep", [("gpt2_tp2pp2_torch", "torch", 1, 1, 1),
                                                       ("llama_tp2pp2_legacy_model", "torch_dist", 2, 2, 1),
                                                       ("gpt2_tp1pp1_legacy_model", "torch_dist", 2, 1, 1),
                                                       ("moe_tp2pp1ep2_torch_dist", "torch_dist", 1, 1, 1),
                                                       ("moe_expert_bias_tp1pp1_torch", "torch_dist", 2, 1, 2),
                                                       ("moe_grouped_gemm_tp2pp1ep2_torch_bf16", "torch", 2, 1, 2),
                                                       ("llama_variants_tp2pp1_torch", "torch_dist", 1, 2, 1),
                                                       ("moe_glm_tp2pp1ep2_torch_dist", "torch", 1, 1, 2),
                                                       ("mtp_tp2pp2_torch", "torch_dist", 2, 1, 1),
                                                       ("mtp_moe_tp1pp1ep2_torch_dist", "torch", 2, 1, 2),
                                                       ("gpt_oss_tp2pp1etp1ep2_torch_dist_core020", "torch", 1, 2, 2),
                                                       ("qwen_attention_tp2pp1_torch", "torch_dist", 1, 2, 1)])
def test_export_then_import_round_trips(name, ckpt_format, tp, pp, ep, tmp_path):
    """Ours -> Megatron-LM at (tp, pp, ep) -> ours: the same weights (and expert bias), and the same logits
    (and multi-token prediction's losses), Megatron's own (grouped-GEMM experts come back as SequentialMLP's,
    which our export writes)."""
    root = _imported(name, tmp_path)
    back = read_megatron_checkpoint(_exported(root, str(tmp_path / "megatron"), tp, pp, ckpt_format,
                                              "--target-expert-parallel-size", str(ep)))
    assert back.ckpt_format == ckpt_format
    reader = CheckpointReader(resolve_checkpoint_dir(root))
    before = {key: reader.read(key) for key in reader.tensors}
    assert set(back.tensors) == set(before)
    for key, tensor in before.items():
        assert torch.equal(back.tensors[key], tensor), key
    saved = megatron_outputs(name)
    reimported = str(tmp_path / "again")
    assert convert(["--source-format", "megatron", "--load-dir", str(tmp_path / "megatron"),
                    "--save-dir", reimported]) == 0
    atol = 2e-2 if "bf16" in name else 1e-5  # both forwards in bf16, each with its own rounding
    assert_megatrons_outputs(our_outputs(reimported, saved), saved, atol)


def test_a_model_megatron_cannot_rebuild_is_refused_by_flag():
    """Gemma 2's norms after each sublayer have no Megatron-LM arg; an imported model's pad token (which row
    trains, not what the weights compute) does not stop an export."""
    config = read_megatron_checkpoint(fixture("llama_tp1pp1_torch_bf16")).config
    padded = dataclasses.replace(config, model=dataclasses.replace(config.model, pad_token_id=0))
    megatron_args_from_config(padded, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, iteration=0,
                              source="ckpt")
    normed = dataclasses.replace(config, model=dataclasses.replace(config.model, post_sublayer_norm=True))
    with pytest.raises(ConfigError, match="its model settings --post-sublayer-norm have no Megatron-LM args"):
        megatron_args_from_config(normed, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  iteration=0, source="ckpt")


@pytest.mark.parametrize("name,flags,message", [
    # Megatron-Core's torch_dist has no layout for it (its sharded state dict asserts): the legacy format.
    ("mtp_tp2pp2_torch", ["torch_dist", "--target-pipeline-parallel-size", "2"],
     "cannot save or load them as torch_dist over pipeline stages"),
    # Megatron-Core keeps biased experts whole (expert-tensor size 1), beside tensor-parallel dense layers.
    ("gpt_oss_tp2pp1etp1ep2_torch_dist_core020", ["torch", "--target-tensor-parallel-size", "2"],
     "its legacy format cannot hold beside --target-tensor-parallel-size 2")])
def test_a_layout_megatron_cannot_hold_is_refused_before_writing(name, flags, message, tmp_path, capsys):
    root = _imported(name, tmp_path)
    assert convert(["--target-format", "megatron", "--load-dir", root, "--save-dir", str(tmp_path / "megatron"),
                    "--megatron-ckpt-format", *flags]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "megatron").exists()


def test_an_export_over_an_existing_iteration_is_refused(tmp_path, capsys):
    root = _imported("gpt2_tp1pp1_legacy_model", tmp_path)
    (tmp_path / "megatron" / "iter_0000010").mkdir(parents=True)
    assert convert(["--target-format", "megatron", "--megatron-ckpt-format", "torch_dist", "--load-dir", root,
                    "--save-dir", str(tmp_path / "megatron")]) == 1
    assert "iter_0000010 exists: a Megatron-LM export is written into a new directory" in capsys.readouterr().err
    assert not os.listdir(tmp_path / "megatron" / "iter_0000010")


def test_common_state_layout_is_refused_outside_a_torch_dist_export(tmp_path, capsys):
    assert convert(["--target-format", "megatron", "--megatron-ckpt-format", "torch", "--megatron-common-state",
                    "distcp", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "out")]) == 1
    assert "--megatron-common-state lays out a torch_dist export" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
