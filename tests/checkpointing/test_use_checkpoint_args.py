"""--use-checkpoint-args takes the model from the checkpoint; --pretrained-checkpoint is where fine-tuning starts."""
import dataclasses

import pytest

from megatron_lite.checkpointing import CheckpointError, read_config, storage
from megatron_lite.checkpointing.offline import reshard_checkpoint
from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import parse_args
from megatron_lite.training.loop import pretrain
from tests.checkpointing.common import tiny_config

# Training flags only: the model comes from the checkpoint.
TRAINING = ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
            "--lr-decay-iters", "10", "--no-log-memory", "--log-interval", "1000"]

# The same model spelled out (tests/checkpointing/common.py's Llama-style tiny_config, epsilon and base changed).
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "4", "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "60",
         "--make-vocab-size-divisible-by", "32", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--position-embedding-type", "rope", "--rotary-base", "500", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A Llama-style checkpoint whose epsilon, rotary base and dropout are not the flags' defaults."""
    root = str(tmp_path_factory.mktemp("pretrained"))
    config = tiny_config(iters=1, save=root)
    config.model.norm_epsilon, config.model.rotary_base, config.model.use_fused_kernels = 1e-6, 500.0, False
    pretrain(config)
    return root


def test_the_model_comes_from_the_checkpoint(pretrained, capsys):
    config = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", pretrained, *TRAINING])
    saved = read_config(pretrained).model
    # Everything but the machine's choice of kernels, which stays this run's (default: on).
    assert config.model == dataclasses.replace(saved, use_fused_kernels=True)
    assert config.model.norm_epsilon == 1e-6 and config.model.rotary_base == 500.0 and config.model.hidden_dropout == 0
    printed = capsys.readouterr().out
    assert f"--use-checkpoint-args: the model of {pretrained}: --num-layers 4 --hidden-size 32" in printed
    assert "--norm-epsilon 1e-06" in printed and "--swiglu" in printed and "--disable-bias-linear" in printed


def test_a_resharded_checkpoint_gives_the_same_model(pretrained, tmp_path):
    resharded = reshard_checkpoint(pretrained, str(tmp_path), tensor_model_parallel_size=2,
                                   pipeline_model_parallel_size=2)
    from_resharded = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", str(tmp_path), *TRAINING])
    assert resharded.endswith("iter_0000001")
    assert from_resharded.model == parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", pretrained,
                                               *TRAINING]).model
    assert from_resharded.parallel.tensor_model_parallel_size == 1  # the layout stays this run's


def test_training_settings_given_override_the_checkpoint(pretrained):
    config = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", pretrained, *TRAINING,
                         "--seq-length", "8", "--hidden-dropout", "0.1", "--num-layers", "4", "--norm-epsilon", "1e-6"])
    assert config.model.seq_length == 8 and config.model.hidden_dropout == 0.1
    assert config.model.num_layers == 4 and config.model.max_position_embeddings == 16  # the checkpoint's


def test_contradicting_flags_are_listed_at_once(pretrained):
    with pytest.raises(ConfigError) as error:
        parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", pretrained, *TRAINING, "--hidden-size", "64",
                    "--num-layers", "4", "--norm-epsilon", "1e-5", "--normalization", "LayerNorm"])
    assert str(error.value).splitlines()[1:] == ["  --hidden-size: checkpoint 32, this run 64",
                                                 "  --normalization: checkpoint RMSNorm, this run LayerNorm",
                                                 "  --norm-epsilon: checkpoint 1e-06, this run 1e-05",
                                                 "Drop them: the checkpoint's values apply."]


def test_a_checkpoint_is_needed(tmp_path):
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load or --pretrained-checkpoint"):
        parse_args(["--use-checkpoint-args", *TRAINING])
    # An empty --load (a first launch) gives nothing to take: the command line must describe the model.
    with pytest.raises(ConfigError, match=f"found no checkpoint in --load {tmp_path} .* --num-layers --hidden-size"):
        parse_args(["--use-checkpoint-args", "--load", str(tmp_path), *TRAINING])
    with pytest.raises(CheckpointError, match=f"--pretrained-checkpoint {tmp_path} holds no checkpoint"):
        parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", str(tmp_path), *TRAINING])
    # Without --use-checkpoint-args the start-up checks refuse it, before the model is built.
    with pytest.raises(CheckpointError, match=f"--pretrained-checkpoint {tmp_path} holds no checkpoint"):
        pretrain(parse_args(MODEL + ["--pretrained-checkpoint", str(tmp_path), *TRAINING]))


def test_pretrained_checkpoint_is_loaded_like_finetune_then_the_run_resumes_from_load(pretrained, tmp_path):
    """Megatron-LM's rule: --pretrained-checkpoint when --load holds nothing yet, --load once it does, so
    a fine-tuning job restarted with the same flags continues instead of starting over."""
    own = str(tmp_path / "finetuned")
    flags = ["--use-checkpoint-args", "--pretrained-checkpoint", pretrained, "--load", own, "--save", own, *TRAINING]
    state, _, _ = pretrain(parse_args(flags))
    assert state.iteration == 2 and state.consumed_train_samples == 4  # started at iteration 0
    control, _, _ = pretrain(parse_args(MODEL + ["--load", pretrained, "--finetune", *TRAINING]))
    assert state.losses == control.losses  # the pretrained weights, weights only, as if spelled out
    assert storage.read_latest_iteration(own) == 2

    resumed, _, _ = pretrain(parse_args(flags + ["--train-iters", "3"]))
    assert resumed.iteration == 3 and resumed.losses[:2] == state.losses


@pytest.fixture(scope="module")
def pretrained_with_tokenizer(tmp_path_factory):
    """A checkpoint whose run named a GPT-2 BPE tokenizer: a real, tiny one, since a run checks that its
    tokenizer fits the model's vocabulary (the model's size is the checkpoint's)."""
    root = tmp_path_factory.mktemp("with_tokenizer")
    (root / "vocab.json").write_text('{"a": 0, "b": 1, "<|endoftext|>": 2}')
    (root / "merges.txt").write_text("#version: 0.2\n")
    config = tiny_config(iters=1, save=str(root / "ckpt"))
    config.model.use_fused_kernels = False
    config.data = dataclasses.replace(config.data, tokenizer_type="GPT2BPETokenizer",
                                      vocab_file=str(root / "vocab.json"), merge_file=str(root / "merges.txt"))
    pretrain(config)
    return root


def test_the_tokenizer_comes_from_the_checkpoint_so_the_next_save_records_it(pretrained_with_tokenizer):
    """Found on a first day: a run resumed with --use-checkpoint-args and no tokenizer flags saved a checkpoint
    naming no tokenizer, whose Hugging Face export then had none (and GPT-2's default EOD id 50256)."""
    root = pretrained_with_tokenizer
    config = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", str(root / "ckpt"), *TRAINING])
    assert (config.data.tokenizer_type, config.data.vocab_file, config.data.merge_file) == (
        "GPT2BPETokenizer", str(root / "vocab.json"), str(root / "merges.txt"))
    # Tokenizer flags on the command line win, as the model flags that do not change the weights do.
    given = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", str(root / "ckpt"), *TRAINING,
                        "--tokenizer-type", "NullTokenizer"])
    assert given.data.tokenizer_type == "NullTokenizer" and given.data.vocab_file is None


def test_a_run_resumed_from_load_keeps_the_checkpoints_tokenizer(pretrained_with_tokenizer, tmp_path, capsys):
    """Found on a first day: a plain --load resume with no tokenizer flags saved checkpoints naming no
    tokenizer, so generation and the Hugging Face export of them had none."""
    root = pretrained_with_tokenizer
    model = [flag for flag in MODEL if flag not in ("--norm-epsilon", "1e-6", "--rotary-base", "500")]  # tiny_config's
    resumed = str(tmp_path / "resumed")
    pretrain(parse_args(model + ["--load", str(root / "ckpt"), "--save", resumed, *TRAINING,
                              "--global-batch-size", "8", "--use-checkpoint-opt_param-scheduler"]))  # one more step
    saved = read_config(resumed).data
    assert (saved.tokenizer_type, saved.vocab_file, saved.merge_file) == (
        "GPT2BPETokenizer", str(root / "vocab.json"), str(root / "merges.txt"))
    assert (f"note: resuming from --load {root / 'ckpt'} with its tokenizer: --tokenizer-type GPT2BPETokenizer "
            f"--vocab-file {root / 'vocab.json'} --merge-file {root / 'merges.txt'}") in capsys.readouterr().out
    # A fine-tune starts a new run, whose data may come from another tokenizer: its flags say which.
    assert parse_args(model + ["--load", str(root / "ckpt"), "--finetune", *TRAINING]).data.tokenizer_type is None
    assert parse_args(model + ["--pretrained-checkpoint", str(root / "ckpt"), "--load", str(tmp_path / "empty"),
                               *TRAINING]).data.tokenizer_type is None
    given = parse_args(model + ["--load", str(root / "ckpt"), *TRAINING, "--tokenizer-type", "NullTokenizer"])
    assert given.data.tokenizer_type == "NullTokenizer" and given.data.vocab_file is None


def test_the_echo_names_only_what_describes_the_model(pretrained, capsys):
    """A dense rotary model's echo leaves out YaRN's, latent attention's and the experts' flags: they are
    taken (and mean nothing here), but a user reading the line would think the model has them."""
    parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", pretrained, *TRAINING])
    printed = capsys.readouterr().out
    echo = next(line for line in printed.splitlines() if "--use-checkpoint-args: the model of" in line)
    for meaningless in ("--kv-lora-rank", "--yarn-", "--mscale", "--moe-", "--rope-scaling-factor", "--rope-type",
                        "--max-position-embeddings", "--softmax-type", "--glu-linear-offset"):
        assert meaningless not in echo
    assert "--rotary-base 500.0" in echo and "--num-query-groups 4" in echo


def test_the_echo_of_a_deepseek_style_model_names_its_router_and_latent_attention(tmp_path, capsys):
    config = tiny_config(iters=1, save=str(tmp_path))
    config.model = dataclasses.replace(
        config.model, num_experts=2, moe_ffn_hidden_size=16, use_fused_kernels=False, multi_latent_attention=True,
        num_query_groups=None, rope_type="yarn",
        kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=8)
    pretrain(config)
    taken = parse_args(["--use-checkpoint-args", "--pretrained-checkpoint", str(tmp_path), *TRAINING]).model
    echo = next(line for line in capsys.readouterr().out.splitlines() if "--use-checkpoint-args:" in line)
    assert "--num-experts 2 --moe-ffn-hidden-size 16" in echo and "--moe-router-topk 2" in echo
    assert "--kv-lora-rank 16" in echo and "--rope-type yarn" in echo and "--rotary-scaling-factor 4.0" in echo
    # Settings of router variants this model does not use stay out (groups, the expert bias, capacity), and
    # those latent attention has no use for (key/value groups: each head has its own keys; the rotated channels
    # are --qk-pos-emb-head-dim's).
    for meaningless in ("--moe-router-group-score", "--moe-token-drop-policy", "--num-query-groups",
                        "--rotary-percent", "--kv-channels"):
        assert meaningless not in echo
    assert taken.moe_router_group_score == config.model.moe_router_group_score  # taken all the same


def test_a_run_keeps_the_hugging_face_family_of_its_checkpoint(tmp_path):
    """An imported Phi-3 computes what a Mistral does: the family it was imported as, recorded in its config,
    is what the checkpoints of a run that loads it record (and so export as), with or without
    --use-checkpoint-args; --hf-model-type wins."""
    pretrained, finetuned = str(tmp_path / "pretrained"), str(tmp_path / "finetuned")
    config = tiny_config(iters=1, save=pretrained)
    config.model.use_fused_kernels, config.model.hf_model_type = False, "phi3"
    pretrain(config)
    start = ["--pretrained-checkpoint", pretrained, *TRAINING, "--save", finetuned]
    pretrain(parse_args([*start, *MODEL, "--norm-epsilon", "1e-5", "--rotary-base", "10000"]))
    assert read_config(finetuned).model.hf_model_type == "phi3"
    assert parse_args(["--use-checkpoint-args", *start]).model.hf_model_type == "phi3"
    assert parse_args(["--use-checkpoint-args", *start, "--hf-model-type", "llama"]).model.hf_model_type == "llama"
    assert parse_args([*MODEL, *TRAINING]).model.hf_model_type is None  # nothing loaded: chosen at export
