"""LoRA against Hugging Face PEFT, and the merge, on GPT-2 and Llama (grouped-query attention).

Small random transformers models are imported with hf_interop; LoRA trains a few steps on
them under --peft lora (all four target modules, so the fused qkv and SwiGLU's [gate; up]
are split for PEFT). Then:
- ``peft`` loading our exported adapters onto the original and onto our exported HF model
  gives our logits;
- the merged checkpoint (megatron_lite and HF) gives the adapted model's logits;
- adapters trained by PEFT itself (a separate A for q, k and v, some modules left out,
  per-module ranks) import exactly, and our own export imports back unchanged.
Prefix tuning is checked against transformers too: its prefix is a key/value cache in
front of real tokens that keep positions 0..s-1.
"""
import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatron_lite.checkpointing import load_checkpoint, read_config  # noqa: E402
from megatron_lite.interop.hf import checkpoint as hf_checkpoint  # noqa: E402
from megatron_lite.checkpointing.resharding import CheckpointReader  # noqa: E402
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir  # noqa: E402
from megatron_lite.config import CheckpointConfig, OptimizerConfig, PeftConfig, TrainingConfig  # noqa: E402
from tests.peft.common import load_single_process  # noqa: E402
from megatron_lite.model.builder import build_model  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_lite.training.loop import pretrain  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB = 100
ATOL = 1e-5


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=500.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def trained(request, tmp_path_factory):
    """(architecture, HF dir, base checkpoint, LoRA checkpoint trained 3 steps, input ids, our logits)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp(request.param)
    hf_dir, base, adapters = str(root / "hf"), str(root / "base"), str(root / "lora")
    {"gpt2": _gpt2, "llama": _llama}[request.param]().save_pretrained(hf_dir)
    hf_checkpoint.import_hf_checkpoint(hf_dir, base)
    config = dataclasses.replace(
        read_config(base), checkpoint=CheckpointConfig(pretrained_checkpoint=base, save=adapters),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=3),
        optimizer=OptimizerConfig(lr=3e-2), peft=PeftConfig(peft="lora", lora_rank=4, lora_alpha=8.0))
    config.model.hidden_dropout = config.model.attention_dropout = 0.0
    config.model.seq_length = 16
    pretrain(config)
    input_ids = torch.randint(0, VOCAB, (2, 16))
    return request.param, hf_dir, base, adapters, input_ids, _our_logits(adapters, input_ids)


def _our_logits(root: str, input_ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_single_process(root)
    with torch.no_grad():
        return model.eval()(input_ids)


def _hf_logits(model, input_ids, **kwargs) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids, **kwargs).logits


def test_lora_moved_the_model(trained):
    _, _, base, _, input_ids, logits = trained
    assert (logits - _our_logits(base, input_ids)).abs().max() > 1e-2


@pytest.mark.parametrize("onto", ["original", "exported"])
def test_peft_loads_our_adapters_and_gives_our_logits(trained, tmp_path, onto):
    architecture, hf_dir, base, adapters, input_ids, logits = trained
    peft_dir, exported = str(tmp_path / "peft"), str(tmp_path / "hf_export")
    assert convert(["--target-format", "peft", "--load-dir", adapters, "--save-dir", peft_dir,
                    "--base-model-name-or-path", hf_dir]) == 0
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    expected_modules = {"gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
                        "llama": ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                  "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]}[architecture]
    assert adapter_config["target_modules"] == expected_modules
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
    if onto == "exported":
        assert convert(["--target-format", "hf", "--load-dir", base, "--save-dir", exported]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir if onto == "original" else exported)
    adapted = peft.PeftModel.from_pretrained(model, peft_dir)
    torch.testing.assert_close(_hf_logits(adapted, input_ids), logits, atol=ATOL, rtol=0)


def test_merged_lora_gives_the_adapted_logits(trained, tmp_path, capsys):
    _, hf_dir, _, adapters, input_ids, logits = trained
    merged, merged_hf = str(tmp_path / "merged"), str(tmp_path / "merged_hf")
    assert convert(["--merge-lora", "--load-dir", adapters, "--save-dir", merged,
                    "--target-tensor-parallel-size", "2"]) == 0
    assert read_config(merged).peft == PeftConfig()
    assert not any(".lora." in k for k in CheckpointReader(resolve_checkpoint_dir(merged)).tensors)
    torch.testing.assert_close(_our_logits(merged, input_ids), logits, atol=ATOL, rtol=0)
    assert convert(["--merge-lora", "--target-format", "hf", "--load-dir", adapters, "--save-dir", merged_hf]) == 0
    torch.testing.assert_close(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(merged_hf), input_ids),
                               logits, atol=ATOL, rtol=0)
    # Merged and written as a Megatron-LM checkpoint in one command (our format in a scratch directory between).
    merged_megatron = str(tmp_path / "merged_megatron")
    assert convert(["--merge-lora", "--target-format", "megatron", "--load-dir", adapters, "--save-dir",
                    merged_megatron, "--target-tensor-parallel-size", "2"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["merged", "merged_hf", "merged_megatron"]
    # Megatron-LM's vocabulary is the padded one (the logits of the padding rows come after ours).
    torch.testing.assert_close(_our_logits(merged_megatron, input_ids)[..., :VOCAB], logits, atol=ATOL, rtol=0)
    # Without --merge-lora the adapters alone are no Megatron-LM model; a whole model has no adapters for PEFT.
    capsys.readouterr()
    assert convert(["--target-format", "megatron", "--load-dir", adapters, "--save-dir", str(tmp_path / "no")]) == 1
    assert "holds no base weights: add --merge-lora" in capsys.readouterr().err
    assert convert(["--source-format", "hf", "--target-format", "peft", "--load-dir", hf_dir, "--save-dir",
                    str(tmp_path / "no")]) == 1
    assert capsys.readouterr().err.startswith("error: --target-format peft writes LoRA adapters, and a hf checkpoint")
    assert not (tmp_path / "no").exists()


def test_our_export_imports_back_unchanged(trained, tmp_path):
    _, _, base, adapters, _, _ = trained
    peft_dir, imported = str(tmp_path / "peft"), str(tmp_path / "imported")
    assert convert(["--target-format", "peft", "--load-dir", adapters, "--save-dir", peft_dir]) == 0
    assert convert(["--source-format", "peft", "--load-dir", peft_dir, "--save-dir", imported,
                    "--base-checkpoint", base]) == 0
    assert read_config(imported).peft == read_config(adapters).peft
    ours, back = (CheckpointReader(resolve_checkpoint_dir(d)) for d in (adapters, imported))
    weights = [k for k in ours.tensors if not k.startswith("optimizer.")]
    assert sorted(weights) == sorted(back.tensors)
    for key in weights:
        torch.testing.assert_close(back.read(key), ours.read(key), atol=1e-7, rtol=0)


def test_adapters_trained_by_peft_import_exactly(trained, tmp_path):
    """PEFT's own LoRA: separate random A for q and v (k left out), gate/up with different ranks, rsLoRA,
    the second layer only."""
    architecture, hf_dir, base, _, input_ids, _ = trained
    targets, ranks = ({"gpt2": (["attn.c_attn", "mlp.c_proj"], {"mlp.c_proj": 3}),
                       "llama": (["q_proj", "v_proj", "gate_proj", "up_proj"], {"up_proj": 3})}[architecture])
    torch.manual_seed(1)
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(hf_dir),
        peft.LoraConfig(r=2, lora_alpha=6, target_modules=targets, rank_pattern=ranks, use_rslora=True,
                        init_lora_weights=False, fan_in_fan_out=architecture == "gpt2", layers_to_transform=[1],
                        layers_pattern={"gpt2": "h", "llama": "layers"}[architecture]))
    peft_dir, imported = str(tmp_path / "peft"), str(tmp_path / "imported")
    model.save_pretrained(peft_dir)
    assert convert(["--source-format", "peft", "--load-dir", peft_dir, "--save-dir", imported,
                    "--base-checkpoint", base]) == 0
    torch.testing.assert_close(_our_logits(imported, input_ids), _hf_logits(model, input_ids), atol=ATOL, rtol=0)
    # PEFT adapters -> the merged Hugging Face model in one command (through our format in a scratch directory).
    merged_hf = str(tmp_path / "merged_hf")
    assert convert(["--source-format", "peft", "--target-format", "hf", "--load-dir", peft_dir, "--save-dir",
                    merged_hf, "--base-checkpoint", base]) == 1  # adapters alone are no whole model
    assert convert(["--source-format", "peft", "--merge-lora", "--target-format", "hf", "--load-dir", peft_dir,
                    "--save-dir", merged_hf, "--base-checkpoint", base]) == 0
    torch.testing.assert_close(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(merged_hf), input_ids),
                               _hf_logits(model, input_ids), atol=ATOL, rtol=0)
    assert sorted(os.listdir(tmp_path)) == ["imported", "merged_hf", "peft"]


def test_prefix_matches_transformers_with_the_prefix_as_a_key_value_cache(trained):
    """Our prefix tuning equals transformers attending over a cache holding the prefix, with the real
    tokens at positions 0..s-1 (no rotation of the prefix, every token sees all of it)."""
    architecture, hf_dir, base, _, input_ids, _ = trained
    config = dataclasses.replace(read_config(base), peft=PeftConfig(peft="prefix", prefix_length=3),
                                 checkpoint=CheckpointConfig(load=base))
    parallel_state = initialize_model_parallel(1, 1)
    (model,) = build_model(config, parallel_state)
    load_checkpoint(config, parallel_state, [model], None, None)
    destroy_model_parallel(parallel_state)
    with torch.no_grad():
        logits = model.eval()(input_ids)
    model_config = config.model
    cache = transformers.DynamicCache()
    batch = input_ids.shape[0]
    for number, layer in model.decoder.layers.items():
        prefix = layer.self_attention.prefix.key_value.detach()  # [p, groups * 2 * head_dim]
        prefix = prefix.view(3, model_config.num_query_groups, 2, model_config.head_dim).permute(2, 1, 0, 3)
        key, value = (t.unsqueeze(0).expand(batch, -1, -1, -1).contiguous() for t in prefix)
        cache.update(key, value, int(number))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    seq = input_ids.shape[1]
    expected = _hf_logits(hf, input_ids, cache=cache, attention_mask=torch.ones(batch, 3 + seq),
                          position_ids=torch.arange(seq).expand(batch, -1), cache_position=torch.arange(3, 3 + seq))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_the_peft_export_records_its_base_for_auto_peft_model(trained, tmp_path):
    """Issue 22, item 14: without --base-model-name-or-path the export wrote null, and
    AutoPeftModelForCausalLM then tried to download a model named "None"."""
    _, hf_dir, _, adapters, input_ids, logits = trained
    peft_dir = str(tmp_path / "peft")
    assert convert(["--target-format", "peft", "--load-dir", adapters, "--save-dir", peft_dir]) == 0
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(hf_dir)
    model = peft.AutoPeftModelForCausalLM.from_pretrained(peft_dir)
    torch.testing.assert_close(_hf_logits(model, input_ids), logits, atol=ATOL, rtol=0)
