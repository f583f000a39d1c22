"""Flags parse into validated config; bad combinations fail naming the flag and the fix."""
import pytest

from megatron_lite.cli.arguments import parse_args
from megatron_lite.config import ConfigError, flag_name
from megatron_lite.cli.megatron_compat import ACCEPTED_FLAGS, REFUSED_FLAGS
from megatron_lite.pretrain_gpt import main

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "100", "--mock-data"]


def test_megatron_flags_parse():
    config = parse_args(BASE + ["--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3",
                                "--min-lr", "1e-5", "--lr-decay-style", "linear", "--lr-warmup-iters", "3",
                                "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--sequence-parallel", "--use-distributed-optimizer", "--bf16",
                                "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                                "--group-query-attention", "--num-query-groups", "2",
                                "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
                                "--clip-grad", "0.5", "--train-iters", "7", "--save", "/tmp/x",
                                "--save-interval", "5", "--split", "98,1,1", "--no-fused-kernels"])
    assert config.training.micro_batch_size == 2 and config.training.global_batch_size == 16
    assert config.parallel.tensor_model_parallel_size == 2 and config.parallel.sequence_parallel
    assert config.model.num_query_groups == 2 and not config.model.add_bias_linear
    assert not config.model.use_fused_kernels
    assert config.optimizer.lr_decay_iters == 7  # defaults to --train-iters
    assert config.training.num_microbatches(data_parallel_size=2) == 4


@pytest.mark.parametrize("flag, nearest", [("--tensor-parallel-size", "--tensor-model-parallel-size"),
                                           ("--num-layer", "--num-layers"), ("--micro-batch", "--micro-batch-size")])
def test_unknown_flag_names_the_nearest_known_one(flag, nearest):
    with pytest.raises(ConfigError, match=f"unrecognized argument {flag} \\(did you mean {nearest}\\?\\)"):
        parse_args(BASE + [flag, "2"])


def test_unknown_flag_without_a_near_one_points_at_help():
    with pytest.raises(ConfigError, match="unrecognized argument --colour-scheme; see --help"):
        parse_args(BASE + ["--colour-scheme", "dark"])


def test_a_missing_vocabulary_names_the_tokenizer_flags():
    with pytest.raises(ConfigError, match="no vocabulary: give --tokenizer-type and its files"):
        parse_args(BASE[:8] + BASE[10:])  # without --vocab-size 100


@pytest.mark.parametrize("extra, match", [
    (["--hidden-size", "66"], r"--hidden-size \(66\) must be divisible by --num-attention-heads \(4\)"),
    (["--tensor-model-parallel-size", "3"], r"--num-attention-heads \(4\) must be divisible by "
                                            r"--tensor-model-parallel-size \(3\)"),
    (["--group-query-attention", "--num-query-groups", "3"], r"--num-query-groups \(3\)"),
    (["--num-query-groups", "2"], "needs --group-query-attention"),
    (["--bf16", "--fp16"], "mutually exclusive"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], "--max-position-embeddings"),
    (["--save-interval", "10"], "needs --save"),
    (["--overlap-param-gather"], "needs --use-distributed-optimizer"),
    (["--data-parallel-sharding-strategy", "zero2"], "invalid choice: 'zero2'"),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"], "drop one of them"),
    (["--grad-cpu-offload"], "needs sharded gradients"),
    (["--data-parallel-sharding-strategy", "optim_grads", "--grad-cpu-offload"], "add --optimizer-cpu-offload"),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--check-weight-hash-across-dp-replicas-interval",
      "5"], "keeps no replicas"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
    (["--lr", "1e-4", "--lr-warmup-init", "1e-3"], r"--lr-warmup-init \(0.001\) must be between 0 and --lr"),
    (["--lr-decay-style", "WSD"], "give a positive --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "100"], "--lr-wsd-decay-samples counts samples"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5", "--lr-wsd-decay-style", "square"],
     "invalid choice: 'square'"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33",
      "--max-position-embeddings", "64"], r"--seq-length \(33\) must be divisible"),
])
def test_bad_combinations_name_the_flag(extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(BASE + extra)


@pytest.mark.parametrize("flags, strategy", [
    ([], "no_shard"), (["--use-distributed-optimizer"], "optim"),
    (["--data-parallel-sharding-strategy", "optim_grads"], "optim_grads"),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads_params"], "optim_grads_params"),
])
def test_sharding_strategy_and_distributed_optimizer_agree(flags, strategy):
    parallel = parse_args(BASE + flags).parallel
    assert parallel.data_parallel_sharding_strategy == strategy
    assert parallel.use_distributed_optimizer == (strategy != "no_shard")  # every ZeRO stage >= 1 shards state


def test_mock_and_real_data_are_exclusive():
    with pytest.raises(ConfigError, match="--mock-data and --data-path both given"):
        parse_args(BASE + ["--data-path", "corpus_text_document"])


def test_no_data_is_an_error():
    with pytest.raises(ConfigError, match="--data-path"):
        parse_args([a for a in BASE if a != "--mock-data"])


def test_batch_arithmetic_is_explained():
    config = parse_args(BASE + ["--micro-batch-size", "3", "--global-batch-size", "16"])
    with pytest.raises(ConfigError, match=r"--global-batch-size \(16\) must be divisible by --micro-batch-size "
                                          r"\(3\) x data-parallel size \(2\) = 6"):
        config.training.num_microbatches(data_parallel_size=2)


def test_world_size_arithmetic_is_shown():
    config = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible .* = 4"):
        config.parallel.data_parallel_size(6)


def test_config_round_trips_through_dict():
    import dataclasses

    from megatron_lite.config import SECTIONS, Config

    assert list(SECTIONS) == [f.name for f in dataclasses.fields(Config)]  # every section has a flag group
    config = parse_args(BASE + ["--swiglu"])
    assert Config.from_dict(config.to_dict()) == config


def test_every_flag_has_a_line_of_help():
    from megatron_lite.cli.arguments import build_parser

    silent = [action.option_strings[0] for action in build_parser()._actions if not action.help]
    assert silent == [], f"flags without --help text (add them to config/help_text.py): {silent}"


def test_a_config_built_in_code_refuses_every_choice_the_parser_refuses():
    """One definition per flag: the parser's choices are the field's, and the section refuses the rest."""
    import dataclasses

    from megatron_lite.cli.arguments import build_parser
    from megatron_lite.config import SECTIONS

    parser_choices = {action.dest: tuple(action.choices) for action in build_parser()._actions if action.choices}
    field_choices = {f.name: tuple(f.metadata["choices"]) for cls in SECTIONS.values() for f in dataclasses.fields(cls)
                     if "choices" in f.metadata}
    assert parser_choices == field_choices
    model = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=10)
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            if "choices" in f.metadata:
                bad = ["nonsense"] if "list" in str(f.type) else "nonsense"
                with pytest.raises(ConfigError, match=f"{flag_name(f.name)} must be one of .*got 'nonsense'"):
                    cls(**(model if cls.__name__ == "ModelConfig" else {}), **{f.name: bad})


def test_choices_are_the_ones_the_code_accepts():
    from megatron_lite.config import WEIGHT_DECAY_INCR_STYLES, WSD_DECAY_STYLES
    from megatron_lite.optimizer.optimizer_param_scheduler import WSD_DECAY_COEFFICIENTS, OptimizerParamScheduler

    assert sorted(WSD_DECAY_COEFFICIENTS) == sorted(WSD_DECAY_STYLES)
    for style in WEIGHT_DECAY_INCR_STYLES:  # each is a schedule the scheduler builds
        OptimizerParamScheduler(_FakeOptimizer(), max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                lr_decay_style="linear", start_wd=0.1, end_wd=0.1 if style == "constant" else 0.2,
                                wd_incr_steps=10, wd_incr_style=style)


class _FakeOptimizer:
    param_groups = [{"params": []}]


# ---------------------------------------------------------------------------------------------
# Megatron-LM flags without a setting of ours (megatron_compat): accepted no-ops and refusals by name.

def _refused_argv(flag):
    refusal = REFUSED_FLAGS[flag]
    return [flag, "2" if "size" in flag else "x"] if refusal.takes_value else [flag]


@pytest.mark.parametrize("flag", sorted(REFUSED_FLAGS))
def test_refused_flags_exit_2_naming_the_flag_without_traceback(flag, capsys):
    assert main(BASE + _refused_argv(flag)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}") and f"is not supported: {REFUSED_FLAGS[flag].reason}; remove it" in err
    assert "Traceback" not in err and "unrecognized" not in err


@pytest.mark.parametrize("argv, reason", [
    (["--moe-use-upcycling"], "mixture of experts takes the --moe-* flags listed in --help"),
    (["--moe-shared-expert-overlap"], "mixture of experts takes the --moe-* flags listed in --help"),
    (["--cuda-graph-scope", "full"], "does not capture CUDA graphs"),
    (["--fp8-wgrad-extra=1"], "no FP8 path"),
    (["--te-precision-config-file", "p.yaml"], "not Transformer Engine"),
])
def test_refused_families_name_each_flag(argv, reason, capsys):
    assert main(BASE + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {argv[0].split('=')[0]} is not supported: ") and reason in err


def test_harmless_values_and_no_op_flags_change_nothing(capsys):
    harmless = [arg for flag, refusal in REFUSED_FLAGS.items() for arg in (flag, *refusal.harmless[:1])
                if refusal.harmless]
    assert parse_args(BASE + harmless + list(ACCEPTED_FLAGS)) == parse_args(BASE)
    assert "note: --ckpt-format torch_dist: saving megatron_lite's own reshardable format" in capsys.readouterr().out


@pytest.mark.parametrize("local_rank", [["--local_rank=3"], ["--local-rank", "3"], ["--local-rank=3"],
                                        ["--local_rank", "3"]])
def test_launchers_local_rank_flag_is_accepted_and_changes_nothing(local_rank):
    # DeepSpeed's launcher and torch.distributed.launch append it; the rank is read from LOCAL_RANK instead.
    assert parse_args(BASE + local_rank) == parse_args(BASE)


def test_refusal_wins_over_an_unknown_flag_and_unknown_flags_still_fail():
    with pytest.raises(ConfigError, match="--fp8-format is not supported"):
        parse_args(BASE + ["--no-such-flag", "--fp8-format", "hybrid"])
    with pytest.raises(ConfigError, match="unrecognized argument --no-such-flag"):
        parse_args(BASE + ["--no-such-flag"])


def test_sequence_parallel_without_tensor_parallelism_warns_and_turns_off():
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect at --tensor-model-parallel-size 1"):
        assert not parse_args(BASE + ["--sequence-parallel"]).parallel.sequence_parallel
    assert parse_args(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2"]).parallel.sequence_parallel


def test_megatron_data_flag_spellings():
    config = parse_args(BASE + ["--split", "'99,1,0'", "--no-mmap-bin-files", "--num-workers", "2",
                                "--tiktoken-pattern", "v1", "--data-cache-path", "/tmp/c"])
    data = config.data
    assert (data.split, data.mmap_bin_files, data.num_workers, data.tiktoken_pattern) == ("99,1,0", False, 2, "v1")
    with pytest.raises(ConfigError, match="--tiktoken-pattern: invalid choice: 'v3'"):
        parse_args(BASE + ["--tiktoken-pattern", "v3"])
    with pytest.raises(ConfigError, match="need --tokenizer-type .*GPT2BPETokenizer"):
        parse_args(BASE + ["--vocab-file", "vocab.json", "--merge-file", "merges.txt"])
