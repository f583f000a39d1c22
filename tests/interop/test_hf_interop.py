"""Hugging Face GPT-2 and Llama checkpoints import into megatron_lite, fine-tune, and export back.

Small random models are built locally with transformers (no downloads). Logits
are compared in float32 (our model returns logits over the unpadded vocabulary).
"""
import copy
import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.interop.hf import checkpoint as hf_checkpoint, weights as hf_weights  # noqa: E402
from megatron_lite.checkpointing import load_checkpoint, read_config  # noqa: E402
from megatron_lite.checkpointing.resharding import CheckpointReader  # noqa: E402
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir  # noqa: E402
from megatron_lite.config import CheckpointConfig, ConfigError  # noqa: E402
from megatron_lite.cli.arguments import parse_args  # noqa: E402
from megatron_lite.data import MockGPTDataset  # noqa: E402
from megatron_lite.pretrain_gpt import main as pretrain_gpt  # noqa: E402
from megatron_lite.training.loop import pretrain  # noqa: E402
from tools.loss_parity import DETERMINISTIC_FLAGS, LOSS_PATTERN, max_relative_difference  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_lite.model.builder import build_model  # noqa: E402
from tests.distributed import run_command_on_ranks, run_distributed  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB = 100  # pads to 128 at tensor-parallel size 1, 256 at 2: the padding changes with the layout
ATOL = 1e-4


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _llama(**head_dim):
    """Grouped-query attention (4 heads, 2 key/value groups), an untied output layer, and an epsilon and
    rotary base that are not our flags' defaults (1e-5, 10000)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0, **head_dim)
    return transformers.LlamaForCausalLM(config)


def _llama_head_dim():
    """Heads of 12 channels with a hidden size of 32 (Megatron's --kv-channels; Llama's head_dim)."""
    return _llama(head_dim=12)


@pytest.fixture(scope="module", params=["gpt2", "llama", "llama-head-dim"])
def hf_model(request, tmp_path_factory):
    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "llama": _llama, "llama-head-dim": _llama_head_dim}[request.param]().eval()
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
    hf_checkpoint.import_hf_checkpoint(directory, root)
    logits = run_distributed(_tensor_parallel_logits, 2, args=(root, input_ids))
    for rank_logits in logits:
        torch.testing.assert_close(rank_logits, reference, atol=ATOL, rtol=0)


def test_export_loads_in_transformers(hf_model, tmp_path):
    name, directory, input_ids, reference = hf_model
    root, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    hf_checkpoint.import_hf_checkpoint(directory, root, tensor_model_parallel_size=2)
    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", root,
                    "--save-dir", exported]) == 0
    model_class = transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM
    model = model_class.from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference, atol=ATOL, rtol=0)
    # The round trip is lossless: the same tensors under the same names.
    _, original = hf_checkpoint.read_hf_directory(directory)
    _, round_trip = hf_checkpoint.read_hf_directory(exported)
    assert original.keys() == round_trip.keys()
    for key in original:
        assert torch.equal(original[key], round_trip[key]), key


@pytest.mark.parametrize("layernorm_1p", [False, True], ids=["plain", "layernorm-1p"])
def test_export_of_a_trained_checkpoint(tmp_path, layernorm_1p):
    """A checkpoint written by training (tp=1, Llama-style) exports and matches our own forward pass;
    with --apply-layernorm-1p the exported norm weights are the scales (stored weight + 1)."""
    from megatron_lite.training.loop import pretrain
    from tests.checkpointing.common import LLAMA, tiny_config

    root, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    pretrain(tiny_config(iters=1, save=root, save_interval=1, arch=dict(LLAMA, apply_layernorm_1p=layernorm_1p)))
    hf_checkpoint.export_hf_checkpoint(root, exported)
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["num_key_value_heads"] == 4
    model = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    input_ids = torch.randint(0, 60, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, _our_logits(root, input_ids), atol=ATOL, rtol=0)


def test_unsupported_variants_are_refused_by_name():
    config = _llama().config.to_dict()
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ConfigError, match="rope scaling 'dynamic'"):
        hf_weights.model_config_from_hf(config)
    with pytest.raises(ConfigError, match="model_type 'bert'"):
        hf_weights.model_config_from_hf({"model_type": "bert"})


def test_head_dim_is_kv_channels():
    config = hf_weights.model_config_from_hf(_llama_head_dim().config.to_dict())
    assert (config.kv_channels, config.head_dim, config.hidden_size) == (12, 12, 32)
    assert hf_weights.hf_config_from_model_config(config)["head_dim"] == 12


def test_qkv_packing_is_per_query_group():
    config = hf_weights.model_config_from_hf(_llama().config.to_dict())  # 4 heads, 2 groups, head_dim 8
    query, key, value = torch.arange(32.0), 100 + torch.arange(16.0), 200 + torch.arange(16.0)
    fused = hf_weights.pack_qkv(query, key, value, config)
    # group 0: its two query heads, then its key and value head; then group 1.
    assert torch.equal(fused[:32], torch.cat([query[:16], key[:8], value[:8]]))
    assert all(torch.equal(a, b) for a, b in zip(hf_weights.unpack_qkv(fused, config), (query, key, value)))


# ---------------------------------------------------------------------------------------------
# Fine-tuning an imported model: its numerics come with it (--use-checkpoint-args) or are checked

# Training flags only. Constant LR, one micro-batch per step: each step is one AdamW step on one batch.
FINETUNE = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4",
            "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1", "--no-log-memory"]


@pytest.fixture(scope="module")
def imported_llama(tmp_path_factory):
    torch.manual_seed(0)
    model = _llama()
    directory, root = str(tmp_path_factory.mktemp("llama")), str(tmp_path_factory.mktemp("llama_ckpt"))
    model.save_pretrained(directory)
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", directory,
                    "--save-dir", root]) == 0
    return model, root


def _transformers_losses(model, steps: int) -> list:
    """The reference: FINETUNE's batches through transformers, stepped by torch.optim.AdamW as Megatron's
    optimizer steps (weight decay 0.01 on matrices only, gradients clipped to global norm 1)."""
    model = copy.deepcopy(model).train()
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    # --mock-data's training samples (seed = --seed 1234), taken in order, two per step.
    data = MockGPTDataset(vocab_size=VOCAB, seq_length=32, seed=1234, num_samples=2 * steps)
    losses = []
    for step in range(steps):
        tokens = torch.stack([torch.from_numpy(data[i]["tokens"]) for i in (2 * step, 2 * step + 1)])
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_finetuning_an_import_with_other_numerics_is_refused(imported_llama, capsys):
    """The architecture spelled out as for any Llama, but --norm-epsilon and --rotary-base left at their
    defaults: one error names both (before, this trained a different model without a word)."""
    _, root = imported_llama
    llama_flags = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads",
                   "4", "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32", "--vocab-size",
                   str(VOCAB), "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                   "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    assert pretrain_gpt(llama_flags + ["--pretrained-checkpoint", root, *FINETUNE]) == 2
    error = capsys.readouterr().err
    assert ("  --norm-epsilon: checkpoint 1e-06, this run 1e-05\n"
            "  --rotary-base: checkpoint 500.0, this run 10000.0\n") in error
    assert "in 2 setting(s)" in error and "--use-checkpoint-args" in error and "Traceback" not in error


def test_finetuning_with_checkpoint_args_matches_transformers(imported_llama):
    """Only training flags: the first loss is transformers' on the same batch, and the steps follow
    transformers + torch.optim.AdamW. (Measured: first loss identical, then ~1e-7 relative. With
    --norm-epsilon left at 1e-5 the first loss is 1e-6 off and later ones 5e-5 to 1e-4.)"""
    model, root = imported_llama
    state, _, _ = pretrain(parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", root, *FINETUNE]))
    reference = _transformers_losses(model, 4)
    relative = [abs(ours - theirs) / theirs for ours, theirs in zip(state.losses, reference)]
    assert len(state.losses) == 4 and relative[0] <= 1e-7 and max(relative) <= 1e-6, (state.losses, reference)


def test_checkpoint_args_on_two_ranks(imported_llama):
    """Two ranks at tensor-parallel size 2 (the vocabulary pads to 256 rows instead of 128): every rank
    reads the checkpoint's model and the losses follow transformers'."""
    model, root = imported_llama
    results = run_command_on_ranks(pretrain_gpt, ["--use-checkpoint-args", "--pretrained-checkpoint", root, *FINETUNE,
                                                  *DETERMINISTIC_FLAGS, "--tensor-model-parallel-size", "2"],
                                   world_size=2, timeout=300)
    assert [code for code, _ in results] == [0, 0], results
    losses = [float(loss) for loss in LOSS_PATTERN.findall(results[1][1])]  # the last rank logs
    # The log prints 7 significant digits: up to 5e-7 relative rounding.
    assert max_relative_difference(_transformers_losses(model, 4), losses) <= 1e-6, losses


def test_converter_flag_mistakes_are_one_line(capsys):
    """Found on a first day: `--target-format huggingface` printed argparse's whole usage block."""
    assert convert(["--load-dir", "a", "--save-dir", "b", "--target-format", "huggingface"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --target-format: invalid choice: 'huggingface'") and err.count("\n") == 1
    assert convert(["--load-dir", "a", "--save-dir", "b", "--target-tensor-parallel", "2"]) == 2
    assert "(did you mean --target-tensor-parallel-size?)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The pad row, and training against transformers + torch.optim.AdamW with clipping on every step

def _llama_config(**tokens):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=False, **tokens)


def _gpt2_config(**tokens):
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, **tokens)


@pytest.mark.parametrize("make, tokens, noted", [
    (_llama_config, dict(bos_token_id=2, eos_token_id=0, pad_token_id=0), "the eos token"),
    (_llama_config, dict(bos_token_id=3, eos_token_id=[0, 4], pad_token_id=3), "the bos token"),
    (_llama_config, dict(bos_token_id=2, eos_token_id=0, pad_token_id=1), None),
    (_gpt2_config, dict(bos_token_id=0, eos_token_id=0, pad_token_id=0), None)],  # GPT-2 has no padding_idx
    ids=["pad-is-eos", "pad-is-bos", "pad-apart", "gpt2"])
def test_the_import_keeps_the_pad_token_and_notes_one_the_data_holds(make, tokens, noted, tmp_path, capsys):
    transformers.AutoModelForCausalLM.from_config(make(**tokens)).save_pretrained(tmp_path / "hf")
    hf_checkpoint.import_hf_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "pad_token_id" in line]
    assert read_config(str(tmp_path / "ckpt")).model.pad_token_id == tokens["pad_token_id"]
    if noted is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith(f"note: pad_token_id {tokens['pad_token_id']} is also "
                                                       f"{noted}") and "--freeze-padding-embedding" in notes[0]


def test_freezing_the_pad_row_needs_a_pad_token(capsys):
    flags = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
             "--vocab-size", "64", "--mock-data", "--micro-batch-size", "1", "--train-iters", "1"]
    assert pretrain_gpt([*flags, "--freeze-padding-embedding"]) == 2
    error = capsys.readouterr().err
    assert error.count("error:") == 1 and "--use-checkpoint-args" in error and "--pad-token-id" in error
    assert parse_args([*flags, "--freeze-padding-embedding", "--pad-token-id", "3"]).model.pad_token_id == 3
    with pytest.raises(ConfigError, match="--pad-token-id \\(64\\) must be a token of the vocabulary"):
        parse_args([*flags, "--pad-token-id", "64"])


def test_checkpoint_args_take_the_pad_token(tmp_path):
    transformers.AutoModelForCausalLM.from_config(_llama_config(eos_token_id=0, pad_token_id=5)).save_pretrained(
        tmp_path / "hf")
    hf_checkpoint.import_hf_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    config = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", str(tmp_path / "ckpt"), *FINETUNE,
                         "--freeze-padding-embedding"])
    assert (config.model.pad_token_id, config.model.freeze_padding_embedding) == (5, True)


# GPT-2 (tied, no padding_idx in transformers: the reference is given one) at tensor 2 x pipeline 2, the tied
# embedding summed over the stages; Llama at pipeline 2 x data 2 under ZeRO-3. The pad: token 1, which the mock
# batches hold.
FAIR_FAMILIES = {"gpt2": lambda: _gpt2_config(bos_token_id=1, eos_token_id=1, pad_token_id=1, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0),  # as our runs' dropout 0
                 "llama": lambda: _llama_config(bos_token_id=1, eos_token_id=1, pad_token_id=1)}
FAIR_LAYOUTS = {"gpt2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                "llama": dict(pipeline_model_parallel_size=2, data_parallel_sharding_strategy="optim_grads_params")}


def test_fine_tuning_equals_transformers_with_clipping(tmp_path):
    from tests.checkpointing.common import import_hf_model
    from tests.interop.transformers_training import fair_fight

    imports = {name: import_hf_model(name, make(), tmp_path / name, vocab=VOCAB)
               for name, make in FAIR_FAMILIES.items()}
    fair_fight(imports, FAIR_LAYOUTS, tmp_path, {}, vocab=VOCAB, pad=1)
