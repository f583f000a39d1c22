"""Multi-token prediction layers in Hugging Face files: DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers.

Each family's tiny model of the MoE harness (``test_hf_moe_families``) with num_nextn_predict_layers 1, its
files given the MTP layer as DeepSeek-V3's release holds it (model.layers.{L}: enorm, hnorm, eh_proj,
shared_head.norm, the decoder layer of a layer L with experts, and copies of embed_tokens and lm_head), widened
as the rest: transformers skips the layer in its forward, so the logits stay transformers'; the layer comes in as
our mtp.layers.0 and goes back bit-exactly; transformers' own MtpModel (its speculative decoding's reading of the
same files) gives the depth-1 logits ours give.
"""
import json
import os

import pytest
import safetensors.torch
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.checkpointing import read_config  # noqa: E402
from megatron_lite.config import ConfigError  # noqa: E402
from megatron_lite.interop.hf import checkpoint as hf_checkpoint  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel  # noqa: E402
from tests.checkpointing.common import widen_and_save  # noqa: E402
from tests.interop.hf_family_ranks import load  # noqa: E402
from tests.interop.test_hf_moe_families import ATOL, FAMILIES, RTOL, VOCAB, _random_expert_bias  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

MTP_FAMILIES = ("deepseek_v3", "glm4_moe")


def _with_mtp_layer(name: str, directory):
    """(model, directory) of family ``name`` with one MTP layer in its files (config.json saying so)."""
    config = FAMILIES[name]()
    config.num_nextn_predict_layers = 1
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    _random_expert_bias(hf_model)
    hf_dir = str(directory / "hf")
    widen_and_save(hf_model, hf_dir)
    # The MTP layer's decoder layer: layer L of the same model one layer deeper (experts, as the last).
    deeper = transformers.AutoModelForCausalLM.from_config(
        type(config)(**{**config.to_dict(), "num_hidden_layers": config.num_hidden_layers + 1}))
    _random_expert_bias(deeper)
    widen_and_save(deeper, str(directory / "deeper"))
    _, deeper_tensors = hf_checkpoint.read_hf_directory(str(directory / "deeper"))
    layer, hidden = f"model.layers.{config.num_hidden_layers}.", config.hidden_size
    _, tensors = hf_checkpoint.read_hf_directory(hf_dir)
    generator = torch.Generator().manual_seed(5)
    tensors.update({key: value for key, value in deeper_tensors.items() if key.startswith(layer)})
    tensors.update({layer + "enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=generator),
                    layer + "hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=generator),
                    layer + "shared_head.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=generator),
                    layer + "eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden, generator=generator),
                    layer + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    layer + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    safetensors.torch.save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    return hf_model, hf_dir


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model, hf_dir = _with_mtp_layer(request.param, directory)
    root = str(directory / "ckpt")
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", hf_dir,
                    "--save-dir", root, "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2"]) == 0
    return request.param, hf_dir, root


def test_import_keeps_the_mtp_layer_and_the_logits_are_transformers(family):
    name, hf_dir, root = family
    assert read_config(root).model.mtp_num_layers == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()  # skips model.layers.{L}
    input_ids = torch.randint(2, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    model, parallel_state = load(root)
    try:
        assert model.mtp is not None
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids), reloaded(input_ids).logits, atol=ATOL, rtol=RTOL)
    finally:
        destroy_model_parallel(parallel_state)


def _transformers_depth_one_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' MtpModel (what its generate(use_mtp=True) drafts with) on ``input_ids``: position i's logits
    for token i + 2, from the main model's last hidden state at i and token i + 1's embedding."""
    from transformers.modeling_layers import MtpModel

    main = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    # It finds the MTP layers by its class's ignore list (model.layers.61 for DeepSeek-V3): ours is layer 2.
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    length = input_ids.shape[1] - 1
    with torch.no_grad():
        hidden = main(input_ids, output_hidden_states=True).hidden_states[-1][:, :length]
        positions = torch.arange(1, length + 1).expand(input_ids.shape[0], length)
        return mtp._project_to_logits(mtp.forward_layer(0, hidden, positions, None, input_ids=input_ids[:, 1:]))


def test_the_mtp_loss_is_transformers_mtp_layers_cross_entropy(family):
    """Our training forward's mtp_1 loss (the trainer's path: labels and loss mask) is the cross entropy of
    transformers' depth-1 logits against the tokens two positions on."""
    name, hf_dir, root = family
    input_ids = torch.randint(2, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    theirs = _transformers_depth_one_logits(hf_dir, input_ids)[:, :-1]  # the last has no token two on
    expected = torch.nn.functional.cross_entropy(theirs.reshape(-1, VOCAB), input_ids[:, 2:].reshape(-1))
    labels = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    loss_mask = torch.ones(2, 16)
    loss_mask[:, -1] = 0  # no next token for the last position
    model, parallel_state = load(root)
    try:
        model.train()
        with torch.no_grad():
            model(input_ids, labels=labels, loss_mask=loss_mask)
        (ours,) = model.mtp.logged_losses
        assert ours.item() == pytest.approx(expected.item(), rel=1e-5)
    finally:
        destroy_model_parallel(parallel_state)


def test_round_trip_with_the_mtp_layer_is_bit_exact(family, tmp_path):
    name, hf_dir, root = family
    exported, again = str(tmp_path / "hf"), str(tmp_path / "again")
    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", root,
                    "--save-dir", exported]) == 0
    hf_config, original = hf_checkpoint.read_hf_directory(hf_dir)
    exported_config, round_trip = hf_checkpoint.read_hf_directory(exported)
    assert exported_config["num_nextn_predict_layers"] == 1
    assert original.keys() == round_trip.keys()
    assert sum(key.startswith("model.layers.2.") for key in original) > 20  # the MTP layer, experts and all
    for key in original:
        assert torch.equal(original[key], round_trip[key]), key
    hf_checkpoint.import_hf_checkpoint(exported, again)
    assert read_config(again).model == read_config(root).model


def test_a_directory_transformers_saved_imports_without_mtp_layers(family, tmp_path, capsys):
    """save_pretrained drops the layers its model has no module for, but keeps num_nextn_predict_layers."""
    name, hf_dir, _ = family
    saved = str(tmp_path / "saved")
    transformers.AutoModelForCausalLM.from_pretrained(hf_dir).save_pretrained(saved)
    hf_checkpoint.import_hf_checkpoint(saved, str(tmp_path / "ckpt"))
    assert read_config(str(tmp_path / "ckpt")).model.mtp_num_layers is None
    assert "num_nextn_predict_layers 1 but the weights hold no multi-token prediction layer" in capsys.readouterr().out


def test_an_mtp_layer_with_its_own_embedding_is_refused(family, tmp_path):
    name, hf_dir, _ = family
    hf_config, tensors = hf_checkpoint.read_hf_directory(hf_dir)
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.layers.2.embed_tokens.weight"] + 1
    changed = str(tmp_path / "changed")
    os.makedirs(changed)
    safetensors.torch.save_file(tensors, os.path.join(changed, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(changed, "config.json"), "w") as f:
        json.dump(hf_config, f)
    with pytest.raises(ConfigError, match="model.layers.2.embed_tokens.weight|layers.2.embed_tokens.weight"):
        hf_checkpoint.import_hf_checkpoint(changed, str(tmp_path / "ckpt"))
