"""Megatron-LM's own example scripts run through ``pretrain_gpt``, sizes scaled down to a CPU.

The flag sets are those of NVIDIA/Megatron-LM's
- ``examples/gpt3/train_gpt3_175b_distributed.sh`` in two versions: as of fa0dcc4872 (Dec 2024), with
  ``--rampup-batch-size 16 16 5859375``, and as of today (779c5b748d), which since April 2026 replaces it
  with ``--step-batch-size-schedule "0:16 2.4B:320 ... 12B:1536"`` next to ``--global-batch-size 1536``.
  Megatron-LM itself rejects that pair (and since Megatron-Core 0.20 ignores ``--rampup-batch-size``);
  we accept the pair when it agrees, and ramp up as Megatron-LM did before.
- ``examples/llama/train_llama3_8b_h100_fp8.sh`` as of b6e883bc59 (Feb 2026), its mock-data branch.

Every flag is kept, one per line as in the script; a comment gives the script's value where the
size was scaled. Data paths, and the tokenizer line the 175B script lacks, are filled in here.
The Llama script's FP8 arguments (added when its ``DTYPE=fp8``) are refused by name; its bf16
run is the script with ``DTYPE=bf16``.
"""
import os
import re
import shlex

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import build_parser, parse_args
from megatron_lite.cli.megatron_compat import REFUSED_FLAGS
from megatron_lite.pretrain_gpt import main
from tools.build_demo_data import build_demo_data

GPT3_175B = """
    --num-layers 2                      # 96
    --hidden-size 64                    # 12288
    --num-attention-heads 4             # 96
    --seq-length 64                     # 2048
    --max-position-embeddings 64        # 2048
    --attention-backend auto
    --micro-batch-size 1
    --global-batch-size 4               # 1536
    --rampup-batch-size 2 2 4           # 16 16 5859375
    --train-iters 3                     # 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 3                  # 430000
    --tensor-model-parallel-size 1      # 8
    --pipeline-model-parallel-size 1    # 16
    --data-path {data_path}
    --vocab-file {vocab_file}
    --merge-file {merge_file}
    --split 949,50,1
    --log-interval 1                    # 100
    --save-interval 2                   # 10000
    --eval-interval 2                   # 1000
    --save {checkpoint_path}
    --load {checkpoint_path}
    --eval-iters 1                      # 10
    --tensorboard-dir {tensorboard_logs_path}
"""
# The script today (779c5b748d, July 2026; unchanged at Megatron-Core 0.20's d98e8a6): a step schedule in
# tokens replaces the ramp-up, next to the --global-batch-size it ends at. Scaled: batches 1, 2, 3 from
# samples 0, 1, 3 (64 tokens each), so each of the 3 iterations takes a new batch.
GPT3_175B_CURRENT = GPT3_175B.replace(
    "--rampup-batch-size 2 2 4           # 16 16 5859375",
    '--step-batch-size-schedule "0:1 64:2 0.192K:3 0.32K:4"  # "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"')
# Not in the script, which Megatron-LM too cannot run without (it builds no tokenizer from None).
GPT3_175B_TOKENIZER = "--tokenizer-type GPT2BPETokenizer"

LLAMA3_8B = """
    --use-mcore-models
    --num-layers 2                      # 32
    --hidden-size 64                    # 4096
    --ffn-hidden-size 224               # 14336
    --num-attention-heads 4             # 32
    --group-query-attention
    --num-query-groups 2                # 8
    --kv-channels 16                    # 128
    --seq-length 64                     # 8192
    --max-position-embeddings 64        # 8192
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --micro-batch-size 1
    --global-batch-size 4               # 128
    --train-samples 12                  # 1953125000
    --lr-decay-samples 12               # 1949218748
    --lr-warmup-samples 4               # 3906252
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --sequence-parallel
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 1000                   # 128256
    --data-cache-path {data_cache_path}
    --tiktoken-pattern v2
    --split "'99,1,0'"                  # the script's array passes the quotes along
    --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files
    --num-workers 1
    --log-interval 1
    --eval-iters 1                      # 32
    --eval-interval 2                   # 100
    --save-interval 2                   # 1000
    --log-throughput
    --profile
    --profile-step-start 1              # 4
    --profile-step-end 2                # 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save {checkpoint_path}
    --load {checkpoint_path}
    --tensorboard-dir {tensorboard_logs_path}
"""
LLAMA3_8B_FP8 = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"

def script_argv(text: str, **paths) -> list[str]:
    lines = [line.split("#", 1)[0] for line in text.strip().splitlines()]
    return shlex.split(" ".join(lines).format(**paths))


def known_flags() -> set[str]:
    return {flag for action in build_parser()._actions for flag in action.option_strings}


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    files = build_demo_data(str(tmp_path_factory.mktemp("demo")), vocab_size=384)
    return dict(data_path=files["--data-path"], vocab_file=files["--vocab-file"], merge_file=files["--merge-file"])


def gpt3_argv(tmp_path, gpt2_data, script: str = GPT3_175B) -> list[str]:
    return script_argv(script, checkpoint_path=tmp_path / "ckpt", tensorboard_logs_path=tmp_path / "tb",
                       **gpt2_data) + GPT3_175B_TOKENIZER.split()


def llama_argv(tmp_path) -> list[str]:
    return script_argv(LLAMA3_8B, checkpoint_path=tmp_path / "ckpt", tensorboard_logs_path=tmp_path / "tb",
                       data_cache_path=tmp_path / "cache")


@pytest.mark.parametrize("text", [GPT3_175B, GPT3_175B_CURRENT, LLAMA3_8B, LLAMA3_8B_FP8],
                         ids=["gpt3-175b", "gpt3-175b-current", "llama3-8b", "fp8"])
def test_every_script_flag_is_known(text):
    """No flag of the scripts can end in argparse's "unrecognized arguments"."""
    flags = {arg for arg in script_argv(text, **dict.fromkeys(
        ["data_path", "vocab_file", "merge_file", "checkpoint_path", "tensorboard_logs_path", "data_cache_path"], "x"))
        if arg.startswith("--")}
    assert flags - known_flags() == set()


def test_gpt3_175b_script_runs(tmp_path, gpt2_data, capsys):
    assert main(gpt3_argv(tmp_path, gpt2_data)) == 0
    out = capsys.readouterr().out
    assert " iteration        3/       3 |" in out and "validation loss at iteration 2" in out
    # --rampup-batch-size 2 2 4: batch 2 until 4 samples are consumed, then --global-batch-size 4.
    assert re.findall(r"global batch size: +(\d+) \|", out) == ["2", "2", "4"]
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000002")


def test_gpt3_175b_current_script_runs(tmp_path, gpt2_data, capsys):
    """Today's script, which Megatron-LM itself rejects (--step-batch-size-schedule next to --global-batch-size):
    the pair agrees (the schedule ends at 4), so it runs, the batch following the schedule and a checkpoint
    written at each micro-batch count change."""
    assert GPT3_175B_CURRENT != GPT3_175B
    assert main(gpt3_argv(tmp_path, gpt2_data, GPT3_175B_CURRENT)) == 0
    out = capsys.readouterr().out
    assert " iteration        3/       3 |" in out and "validation loss at iteration 2" in out
    assert re.findall(r"global batch size: +(\d+) \|", out) == ["1", "2", "3"]
    assert re.findall(r"consumed samples: +(\d+) \|", out) == ["1", "3", "6"]
    assert {"iter_0000001", "iter_0000002", "iter_0000003"} <= set(os.listdir(tmp_path / "ckpt"))


def test_llama3_8b_script_runs(tmp_path, capsys):
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect at --tensor-model-parallel-size 1"):
        assert main(llama_argv(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "note: --ckpt-format torch_dist: saving megatron_lite's own reshardable format" in out
    assert " iteration        3/       3 |" in out
    config = parse_args(llama_argv(tmp_path))
    model, data = config.model, config.data
    assert (model.kv_channels, model.apply_layernorm_1p, model.attention_backend) == (16, True, "fused")
    assert not config.parallel.sequence_parallel and data.split == "99,1,0"
    assert (data.mmap_bin_files, data.num_workers, data.tiktoken_pattern) == (False, 1, "v2")
    training, optimizer = config.training, config.optimizer
    assert (training.train_samples, optimizer.lr_warmup_samples, optimizer.lr_decay_samples) == (12, 4, 12)
    assert (optimizer.decoupled_lr, optimizer.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    assert training.calculate_per_token_loss and config.parallel.grad_reduce_in_bf16
    assert training.manual_gc and training.empty_unused_memory_level == 1 and training.exit_duration_in_mins == 235
    assert config.parallel.distributed_timeout_minutes == 60
    # --log-throughput puts TFLOP/s in the line; --profile wrote a trace of iteration 1 for TensorBoard.
    assert out.count("throughput per GPU (TFLOP/s/GPU)") == 3
    assert any(name.endswith(".pt.trace.json") for name in os.listdir(tmp_path / "tb"))


def test_gpt3_175b_script_on_two_ranks(tmp_path, gpt2_data):
    """The 175B flag set on two ranks (its tensor x pipeline layout scaled to one pipeline split)."""
    from tests.distributed import run_command_on_ranks
    from tools.loss_parity import DETERMINISTIC_FLAGS, LOSS_PATTERN

    argv = [*gpt3_argv(tmp_path, gpt2_data), *DETERMINISTIC_FLAGS, "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "2"]
    results = run_command_on_ranks(main, argv, world_size=2, timeout=300)
    assert [code for code, _ in results] == [0, 0], results
    # The last stage logs every iteration; fp16 at the script's initial scale skips these first ones for overflow,
    # so, as in Megatron-LM, their lines carry no loss (never a NaN that nothing computed).
    assert len(re.findall(r" iteration +\d+/ +3 \|", results[1][1])) == 3
    assert LOSS_PATTERN.findall(results[1][1]) == []
    assert results[1][1].count("number of skipped iterations:   1 |") == 3
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000002")


def test_no_flag_is_awaited():
    """Issue 12's training flags, which the scripts once ran without, are all there."""
    training_flags = {"--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--lr-warmup-fraction",
                      "--rampup-batch-size", "--calculate-per-token-loss", "--decoupled-lr", "--decoupled-min-lr",
                      "--grad-reduce-in-bf16", "--distributed-timeout-minutes", "--exit-duration-in-mins",
                      "--log-throughput", "--manual-gc", "--empty-unused-memory-level", "--profile",
                      "--profile-step-start", "--profile-step-end"}
    assert training_flags - known_flags() == set()


@pytest.mark.parametrize("flag", LLAMA3_8B_FP8.split()[::2][:3] + ["--fp8-param-gather"])
def test_fp8_flags_are_refused_by_name(flag, capsys):
    argv = script_argv(LLAMA3_8B_FP8)
    start = argv.index(flag)
    single = argv[start:start + (2 if REFUSED_FLAGS[flag].takes_value else 1)]
    assert main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--vocab-size", "100", "--mock-data", *single]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} is not supported: megatron_lite has no FP8 path "
                          "(needs Transformer Engine on Hopper); remove it.")
    assert "Traceback" not in err


def test_whole_fp8_script_is_refused(tmp_path, capsys):
    assert main(llama_argv(tmp_path) + script_argv(LLAMA3_8B_FP8)) == 2
    assert "is not supported: megatron_lite has no FP8 path" in capsys.readouterr().err


def test_script_values_that_need_what_we_lack_are_refused(tmp_path):
    base = llama_argv(tmp_path)
    with pytest.raises(ConfigError, match=r"--cp-comm-type: invalid choice: 'a2a'"):
        parse_args(base + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"])
    with pytest.raises(ConfigError, match=r"--ckpt-format torch is not supported: .*give --ckpt-format torch_dist"):
        parse_args(base + ["--ckpt-format", "torch"])
