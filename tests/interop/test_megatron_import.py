"""Real Megatron-LM checkpoints (tests/fixtures/megatron, built by tools/make_megatron_fixtures.py with
Megatron-LM's own code) import into megatron_lite and give Megatron's logits, at 1 process and tp2 x pp2."""
import dataclasses
import os
import re

import pytest
import safetensors.torch
import torch

from megatron_lite.checkpointing import load_checkpoint, read_config
from megatron_lite.interop.megatron.importer import read_megatron_checkpoint
from megatron_lite.config import CheckpointConfig, ConfigError
from megatron_lite.model.builder import build_model
from megatron_lite.model.multi_token_prediction import logged_losses as mtp_logged_losses
from megatron_lite.pipeline_parallel import p2p
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.distributed import run_distributed
from tools.checkpoint_convert import main as convert

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron")
ATOL = 1e-5


def fixture(name: str) -> str:
    path = os.path.join(FIXTURES, name)
    if not os.path.isdir(path):
        pytest.skip(f"{name} was not built by tools/make_megatron_fixtures.py")
    return path


def megatron_outputs(name: str) -> dict:
    """What tools/make_megatron_fixtures.py saved of Megatron's forward: "tokens" and "logits"; for a
    multi-token prediction fixture also "labels", the training forward's "lm_loss" per token and "mtp_losses"
    (L_k of each depth)."""
    return safetensors.torch.load_file(os.path.join(fixture(name), "logits.safetensors"))


def megatron_logits(name: str) -> tuple:
    saved = megatron_outputs(name)
    return saved["tokens"], saved["logits"]


def our_logits(root: str, tokens: torch.Tensor, tp: int = 1, pp: int = 1):
    """Our model loaded from ``root`` at (tp, pp) in this process's world: the logits on the last stage."""
    outputs = our_outputs(root, {"tokens": tokens}, tp, pp)
    return None if outputs is None else outputs["logits"]


def our_outputs(root: str, saved: dict, tp: int = 1, pp: int = 1):
    """``megatron_outputs``' entries for ``saved``'s tokens (and labels) from our model loaded from ``root`` at
    (tp, pp) in this process's world, on the last stage (None elsewhere): the losses from the training forward
    (dropout is 0) and multi-token prediction's L_k as the trainer logs them."""
    config = read_config(root)
    config = dataclasses.replace(config, checkpoint=CheckpointConfig(load=root), parallel=dataclasses.replace(
        config.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    parallel_state = initialize_model_parallel(tp, pp)
    try:
        (model,) = build_model(config, parallel_state)
        load_checkpoint(config, parallel_state, [model], None, None)
        model.eval()
        with torch.no_grad():
            logits = _stage_forward(model, saved["tokens"], parallel_state, config.model.hidden_size)
            if "labels" not in saved:
                return None if logits is None else {"logits": logits}
            model.train()
            labels = saved["labels"]
            lm_loss = _stage_forward(model, saved["tokens"], parallel_state, config.model.hidden_size,
                                     labels=labels, loss_mask=torch.ones(labels.shape))
        if logits is None:
            return None
        depths = mtp_logged_losses(model)
        return {"logits": logits, "lm_loss": lm_loss,
                "mtp_losses": torch.stack([depths[f"mtp_{k} loss"][0] for k in range(1, len(depths) + 1)])}
    finally:
        destroy_model_parallel(parallel_state)


def _stage_forward(model, tokens, parallel_state, hidden_size, **kwargs):
    """This stage's forward; the stages hand activations [s, b, h] on. The last stage's logits (given labels,
    its loss), else None."""
    exchange = dict(shape=(tokens.shape[1], tokens.shape[0], hidden_size), dtype=torch.float32,
                    device=torch.device("cpu"), group=parallel_state.pipeline_model_parallel_group)
    if not parallel_state.is_pipeline_first_stage():
        (received,) = p2p.exchange(sends=[], receives=[parallel_state.pipeline_prev_rank], **exchange)
        model.set_input_tensor(received)
    output = model(tokens, **kwargs)
    if not parallel_state.is_pipeline_last_stage():
        p2p.exchange(sends=[(output, parallel_state.pipeline_next_rank)], receives=[], **exchange)
        return None
    return output


# Megatron-Core's model in the legacy format, the legacy model's nested layout, torch_dist of core 0.17
# (common.pt) and of main (the common state inside the .distcp files), the exact GeLU.
ALL = ["gpt2_tp2pp2_torch", "llama_tp1pp1_torch_bf16", "gpt2_tp1pp1_legacy_model", "llama_tp2pp2_legacy_model",
       "gpt2_tp2pp1_torch_dist", "llama_tp2pp1_torch_dist_core020",
       "gpt2_tp2pp1_exact_gelu",  # --no-bias-gelu-fusion: the erf GeLU (our --gelu-exact)
       "moe_tp1pp1_torch", "moe_tp2pp1ep2_torch",  # 4 experts top-2, in one file and over 2 expert ranks x 2 tp
       "moe_tp2pp1ep2_torch_dist",  # the experts stacked [layers, experts, ...] in torch_dist
       "moe_tp2pp1etp1ep2_torch_dist",  # ... there at --expert-tensor-parallel-size 1 under tensor size 2
       "moe_expert_bias_tp1pp1_torch",  # sigmoid scores and the router's expert bias (a buffer)
       "moe_grouped_gemm_tp2pp1ep2_torch_bf16",  # core 0.16's GroupedMLP: weight1/weight2 per rank, bf16
       # query/key norms, the QKV projection's biases alone, a sliding window on every other layer, Llama 3's
       # RoPE scaling; the same norms and biases with linear RoPE scaling in torch_dist
       "llama_variants_tp2pp1_torch", "llama_variants_tp2pp1_torch_dist",
       "moe_glm_tp2pp1ep2_torch_dist",  # GLM-4.5's: grouped sigmoid routing, expert bias, gated shared expert
       # multi-token prediction (its losses too): 2 depths, tied embeddings over 2 stages; 1 depth with experts
       "mtp_tp2pp2_torch", "mtp_moe_tp1pp1ep2_torch_dist",
       # gpt-oss's sinks, clamped quick GeGLU, biases (experts' too), windows and YaRN, in main's torch_dist, its
       # layers keyed one by one (a dense layer, then experts); Qwen's QK norms, gated attention and QKV bias
       "gpt_oss_tp2pp1etp1ep2_torch_dist_core020", "qwen_attention_tp2pp1_torch"]


def assert_megatrons_outputs(ours: dict, saved: dict, atol: float = ATOL) -> None:
    """Our logits (and multi-token prediction fixtures' losses: the language model's per token, each depth's L_k)
    are those Megatron-LM saved."""
    assert sorted(ours) == sorted(set(saved) - {"tokens", "labels"})
    for key, value in ours.items():
        torch.testing.assert_close(value.float(), saved[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ALL)
def test_import_gives_megatrons_logits(name, tmp_path):
    saved = megatron_outputs(name)
    root = str(tmp_path / "ours")
    assert convert(["--source-format", "megatron", "--load-dir", fixture(name), "--save-dir", root]) == 0
    atol = 2e-2 if "bf16" in name else ATOL  # both forwards in bf16, each with its own rounding
    assert_megatrons_outputs(our_outputs(root, saved), saved, atol)


def _pipeline_outputs(rank, world_size, root, saved):
    return our_outputs(root, saved, tp=2, pp=2)


@pytest.mark.parametrize("name", ["gpt2_tp2pp2_torch", "llama_tp2pp2_legacy_model", "moe_tp2pp1ep2_torch",
                                  "mtp_tp2pp2_torch", "gpt_oss_tp2pp1etp1ep2_torch_dist_core020"])
def test_import_at_tp2_pp2_gives_megatrons_logits(name, tmp_path):
    saved = megatron_outputs(name)
    root = str(tmp_path / "ours")
    assert convert(["--source-format", "megatron", "--load-dir", fixture(name), "--save-dir", root,
                    "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]) == 0
    results = run_distributed(_pipeline_outputs, 4, args=(root, saved))
    last_stage = [r for r in results if r is not None]
    assert len(last_stage) == 2
    for outputs in last_stage:
        assert_megatrons_outputs(outputs, saved)


def test_the_saved_args_map_to_our_config():
    llama = read_megatron_checkpoint(fixture("llama_tp1pp1_torch_bf16"))
    config = llama.config.model
    # GQA on: the groups are args.num_query_groups; the padded vocabulary is the model's; epsilon from norm_epsilon.
    assert (config.num_query_groups, config.vocab_size, config.norm_epsilon) == (2, 32, 1e-6)
    assert config.swiglu and config.untie_embeddings_and_output_weights and config.position_embedding_type == "rope"
    # --bf16: the weights are kept in bf16, and the config says so (an export writes bf16 again).
    assert llama.config.training.bf16 and {t.dtype for t in llama.tensors.values()} == {torch.bfloat16}
    gpt2 = read_megatron_checkpoint(fixture("gpt2_tp2pp2_torch")).config
    assert gpt2.model.num_query_groups == gpt2.model.num_attention_heads == 2  # args hold 1 with GQA off
    assert not gpt2.training.bf16 and gpt2.params_dtype == torch.float32


def test_unsupported_megatron_args_are_refused_by_name():
    import argparse
    from megatron_lite.interop.megatron.args_mapping import model_config_from_megatron_args
    args = argparse.Namespace(moe_latent_size=8, rotary_interleaved=True, experimental_attention_variant="gdn",
                              swiglu=True, glu_linear_offset=1.0, mtp_num_layers=1, mtp_use_repeated_layer=True,
                              window_size=(4, 0), window_attn_skip_freq=[1, 0])
    with pytest.raises(ConfigError, match=r"--moe-latent-size \(latent experts\).*--mtp-use-repeated-layer.*"
                                          r"--rotary-interleaved.*"
                                          r"--experimental-attention-variant.*--window-attn-skip-freq as a list.*"
                                          r"--glu-linear-offset .* with --swiglu and its fusion.*"
                                          r"--mtp-num-layers with --window-attn-skip-freq"):
        model_config_from_megatron_args(args, "ckpt")


def test_training_and_generate_start_straight_from_a_megatron_dir(tmp_path, monkeypatch):
    from megatron_lite.cli.arguments import parse_args
    from megatron_lite.inference.loading import read_checkpoint_config
    from megatron_lite.config import ParallelConfig
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the one-time import is cached
    name = "gpt2_tp1pp1_legacy_model"
    tokens, reference = megatron_logits(name)
    config = parse_args(["--pretrained-checkpoint", fixture(name), "--use-checkpoint-args", "--micro-batch-size",
                         "2", "--global-batch-size", "2", "--train-iters", "1", "--mock-data", "--lr", "1e-4"])
    assert config.model == read_megatron_checkpoint(fixture(name)).config.model
    assert config.checkpoint.pretrained_checkpoint.startswith(str(tmp_path))
    torch.testing.assert_close(our_logits(config.checkpoint.pretrained_checkpoint, tokens), reference, atol=ATOL,
                               rtol=0)
    generating = read_checkpoint_config(fixture(name), ParallelConfig())
    assert generating.model == config.model and generating.checkpoint.load == config.checkpoint.pretrained_checkpoint


def _te_norm_names(key: str) -> str:
    """Transformer Engine's layers: the norm inside the next linear."""
    renames = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return next((key.replace(ours, te) for ours, te in renames.items() if ours in key), key)


def _te_grouped_linear_names(key: str) -> str:
    """Transformer Engine's TEGroupedMLP (--moe-grouped-gemm): a rank's experts in one GroupedLinear per linear,
    ``linear_fc1.weight{i}`` and one ``_extra_state``."""
    return re.sub(r"\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$",
                  lambda m: f".{m[2]}.{m[3]}{m[1] if m[3] == 'weight' else ''}", key)


def _core016_mtp_names(key: str) -> str:
    """Megatron-Core 0.16's legacy files name a multi-token prediction layer's transformer layer
    ``transformer_layer``."""
    return key.replace(".mtp_model_layer.", ".transformer_layer.")


@pytest.mark.parametrize("name,rename,renamed", [
    ("gpt2_tp2pp2_torch", _te_norm_names, "decoder.layers.0.mlp.linear_fc1.layer_norm_bias"),
    ("moe_tp2pp1ep2_torch", _te_grouped_linear_names, "decoder.layers.1.mlp.experts.linear_fc2.weight1"),
    ("mtp_tp2pp2_torch", _core016_mtp_names, "mtp.layers.1.transformer_layer.mlp.linear_fc2.weight")])
def test_transformer_engine_layer_names_load_too(name, rename, renamed, tmp_path):
    """Legacy files whose layers carry Transformer Engine's names (the norm inside the next linear; grouped
    experts' linears) or core 0.16's (multi-token prediction's ``transformer_layer``), made from a Megatron
    fixture by renaming its tensors (Transformer Engine does not run on a CPU): the same logits."""
    from megatron_lite.interop.megatron.legacy import rank_files
    from megatron_lite.interop.megatron.safe_unpickle import StandIn, load_torch_file
    tokens, reference = megatron_logits(name)
    names = set()
    for source in rank_files(os.path.join(fixture(name), "iter_0000010")).values():
        state = load_torch_file(source)
        for key, value in vars(state["args"]).items():  # stand-ins name no importable class: save them as None
            if isinstance(value, StandIn):
                setattr(state["args"], key, None)
        state["model"] = {rename(k): v for k, v in state["model"].items()}
        names |= set(state["model"])
        te_dir = tmp_path / "te" / "iter_0000010" / os.path.basename(os.path.dirname(source))
        te_dir.mkdir(parents=True)
        torch.save(state, te_dir / "model_optim_rng.pt")
    assert renamed in names
    (tmp_path / "te" / "latest_checkpointed_iteration.txt").write_text("10")
    root = str(tmp_path / "ours")
    assert convert(["--source-format", "megatron", "--load-dir", str(tmp_path / "te"), "--save-dir", root]) == 0
    torch.testing.assert_close(our_logits(root, tokens), reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gpt2_tp2pp2_torch", "llama_tp2pp2_legacy_model"])
def test_megatron_and_hugging_face_convert_into_each_other_in_one_command(name, tmp_path):
    """Megatron-LM -> Hugging Face: transformers gives Megatron's logits; that directory -> Megatron-LM at tp2 x pp2,
    imported again, gives them too. Each command goes through our format in a scratch directory it removes."""
    import transformers

    tokens, reference = megatron_logits(name)
    hf_dir, megatron_dir = str(tmp_path / "hf"), str(tmp_path / "megatron")
    assert convert(["--source-format", "megatron", "--target-format", "hf", "--load-dir", fixture(name),
                    "--save-dir", hf_dir]) == 0
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits
    torch.testing.assert_close(hf_logits, reference, atol=1e-4, rtol=0)
    assert convert(["--source-format", "hf", "--target-format", "megatron", "--load-dir", hf_dir, "--save-dir",
                    megatron_dir, "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]) == 0
    assert convert(["--source-format", "megatron", "--load-dir", megatron_dir,
                    "--save-dir", str(tmp_path / "ours")]) == 0
    # The Megatron-LM export pads the vocabulary to its own multiple: the columns past the fixture's are padding.
    again = our_logits(str(tmp_path / "ours"), tokens)
    torch.testing.assert_close(again[..., :reference.shape[-1]], reference, atol=ATOL, rtol=0)
    assert sorted(os.listdir(tmp_path)) == ["hf", "megatron", "ours"]  # no scratch left behind


def test_legacy_experts_split_otherwise_than_the_dense_layers_are_refused(tmp_path, capsys):
    """A legacy file names its dense tensor rank and expert rank only: experts over another
    --expert-tensor-parallel-size are refused by name, pointing at torch_dist (whole tensors)."""
    from megatron_lite.interop.megatron.legacy import rank_files
    from megatron_lite.interop.megatron.safe_unpickle import StandIn, load_torch_file
    (source,) = rank_files(os.path.join(fixture("moe_tp1pp1_torch"), "iter_0000010")).values()
    state = load_torch_file(source)
    for key, value in vars(state["args"]).items():
        if isinstance(value, StandIn):
            setattr(state["args"], key, None)
    state["args"].expert_tensor_parallel_size = 2
    (tmp_path / "etp" / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    torch.save(state, tmp_path / "etp" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "etp" / "latest_checkpointed_iteration.txt").write_text("10")
    assert convert(["--source-format", "megatron", "--load-dir", str(tmp_path / "etp"),
                    "--save-dir", str(tmp_path / "ours")]) == 1
    assert "--expert-tensor-parallel-size 2 ranks, not the tensor-parallel 1" in capsys.readouterr().err
