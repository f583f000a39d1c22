"""Hugging Face GPT-2 and Llama checkpoints import into megatron_lite and export back.

Small random models are built locally with transformers (no downloads). Logits
are compared in float32 (our model returns logits over the unpadded vocabulary).
"""
import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.checkpointing import hf_interop  # noqa: E402
from megatron_lite.checkpointing import load_checkpoint, read_config  # noqa: E402
from megatron_lite.checkpointing.resharding import CheckpointReader  # noqa: E402
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir  # noqa: E402
from megatron_lite.config import CheckpointConfig, ConfigError  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_lite.model.builder import build_model  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB = 100  # pads to 128 at tensor-parallel size 1, 256 at 2: the padding changes with the layout
ATOL = 1e-4


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    """Grouped-query attention (4 heads, 2 key/value groups) and an untied output layer."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rope_theta=500.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_model(request, tmp_path_factory):
    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "llama": _llama}[request.param]().eval()
    directory = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(directory)
    input_ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        logits = model(input_ids).logits
    return request.param, directory, input_ids, logits


def _our_logits(root: str, input_ids: torch.Tensor, tp: int = 1) -> torch.Tensor:
    """Load ``root`` into a model at tensor-parallel size ``tp`` (this process's world) and run it."""
    config = read_config(root)
    config = dataclasses.replace(config, checkpoint=CheckpointConfig(load=root), parallel=dataclasses.replace(
        config.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1))
    parallel_state = initialize_model_parallel(tp, 1)
    try:
        (model,) = build_model(config, parallel_state)
        load_checkpoint(config, parallel_state, [model], None, None)
        model.eval()
        with torch.no_grad():
            return model(input_ids)
    finally:
        destroy_model_parallel(parallel_state)


def _tensor_parallel_logits(rank, world_size, root, input_ids):
    return _our_logits(root, input_ids, tp=world_size)


def test_import_matches_transformers(hf_model, tmp_path):
    name, directory, input_ids, reference = hf_model
    root = str(tmp_path / "ckpt")
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", directory,
                    "--save-dir", root, "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2"]) == 0
    metadata = CheckpointReader(resolve_checkpoint_dir(root)).metadata
    assert metadata["optimizer"] is None and metadata["layout"]["tensor_model_parallel_size"] == 2
    assert metadata["tensors"]["embedding.word_embeddings.weight"]["global_shape"][0] == 256
    logits = _our_logits(root, input_ids)  # loaded at tp=1: the padding shrinks to 128 rows
    assert logits.shape == (2, 16, VOCAB)
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)


def test_import_runs_under_tensor_parallelism(hf_model, tmp_path):
    name, directory, input_ids, reference = hf_model
    root = str(tmp_path / "ckpt")
    hf_interop.import_hf_checkpoint(directory, root)
    logits = run_distributed(_tensor_parallel_logits, 2, args=(root, input_ids))
    for rank_logits in logits:
        torch.testing.assert_close(rank_logits, reference, atol=ATOL, rtol=0)


def test_export_loads_in_transformers(hf_model, tmp_path):
    name, directory, input_ids, reference = hf_model
    root, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    hf_interop.import_hf_checkpoint(directory, root, tensor_model_parallel_size=2)
    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", root,
                    "--save-dir", exported]) == 0
    model_class = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[name]
    model = model_class.from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference, atol=ATOL, rtol=0)
    # The round trip is lossless: the same tensors under the same names.
    _, original = hf_interop.read_hf_directory(directory)
    _, round_trip = hf_interop.read_hf_directory(exported)
    assert original.keys() == round_trip.keys()
    for key in original:
        assert torch.equal(original[key], round_trip[key]), key


def test_export_of_a_trained_checkpoint(tmp_path):
    """A checkpoint written by training (tp=1, Llama-style) exports and matches our own forward pass."""
    from megatron_lite.training.loop import pretrain
    from tests.checkpointing.common import tiny_config

    root, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    pretrain(tiny_config(iters=1, save=root, save_interval=1))
    hf_interop.export_hf_checkpoint(root, exported)
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["num_key_value_heads"] == 4
    model = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    input_ids = torch.randint(0, 60, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, _our_logits(root, input_ids), atol=ATOL, rtol=0)


def test_unsupported_variants_are_refused_by_name():
    config = _llama().config.to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ConfigError, match="rope scaling 'yarn'"):
        hf_interop.model_config_from_hf(config)
    with pytest.raises(ConfigError, match="model_type 'bert'"):
        hf_interop.model_config_from_hf({"model_type": "bert"})


def test_qkv_packing_is_per_query_group():
    config = hf_interop.model_config_from_hf(_llama().config.to_dict())  # 4 heads, 2 groups, head_dim 8
    query, key, value = torch.arange(32.0), 100 + torch.arange(16.0), 200 + torch.arange(16.0)
    fused = hf_interop.pack_qkv(query, key, value, config)
    # group 0: its two query heads, then its key and value head; then group 1.
    assert torch.equal(fused[:32], torch.cat([query[:16], key[:8], value[:8]]))
    assert all(torch.equal(a, b) for a, b in zip(hf_interop.unpack_qkv(fused, config), (query, key, value)))
