"""``python -m megatron_lite.evaluate`` at the trainer's layouts gives one process's numbers: the perplexity of
an indexed dataset and of fine-tuning data, and the exact match of greedy answers (each answer in input order
in --output-file), at tp2 x pp2, dp2, and ep2 for a mixture of experts (whose data-parallel ranks run filler
batches to stay in step), and with each sequence split over 2 context-parallel ranks beside tensor, pipeline,
data and expert parallelism. The checkpoints were trained with dropout, which context parallelism's ring
attention cannot train with, and which evaluation does not use; the dense one has a multi-token prediction
layer (DeepSeek-V3's), which training cannot split over context-parallel ranks, and which evaluation does not
run."""
import json
import re

import numpy as np
import pytest

from megatron_lite.checkpointing.offline import write_checkpoint
from megatron_lite.config import DataConfig
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lite.evaluate import main
from tests.distributed import run_command_on_ranks
from tests.inference.models import build, config_of
from tools.build_sft_demo_data import VOCAB_SIZE, write_splits

MOE = dict(num_experts=4, moe_ffn_hidden_size=32)


def _checkpoint(root, **model_fields) -> str:
    """A random model of the sft demo's vocabulary (its NullTokenizer's EOD the last id) written to ``root``."""
    fields = dict(vocab_size=VOCAB_SIZE + 1, seq_length=24, **model_fields)
    config = config_of("rope_gqa", **fields, attention_dropout=0.1)
    config.data = DataConfig(mock_data=True, tokenizer_type="NullTokenizer")
    model, _ = build("rope_gqa", **fields)
    weights = dict(model.named_parameters())
    write_checkpoint(str(root), config, lambda name: weights[name].detach(), iteration=0)
    return str(root)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An indexed corpus of 6 windows of 25 tokens (3 batches of 2: uneven over 2 data-parallel ranks), and 5 of
    the reversal task's held-out examples."""
    root = tmp_path_factory.mktemp("evaluate")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(root / "corpus.bin"), np.int32) as builder:
        for _ in range(12):
            builder.add_document(np.append(rng.integers(0, VOCAB_SIZE, size=13), VOCAB_SIZE))
        builder.finalize(str(root / "corpus.idx"))
    test = write_splits(str(root / "sft"), train=10, valid=1, test=5)["test"]
    return {"corpus": str(root / "corpus"), "sft": test,
            "dense": _checkpoint(root / "dense", mtp_num_layers=1), "moe": _checkpoint(root / "moe", **MOE)}


RUNS = {"indexed": ["--micro-batch-size", "2"],
        "sft": ["--sft", "--exact-match", "--max-new-tokens", "6", "--micro-batch-size", "2"]}
TP2, PP2, CP2 = (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                 ["--context-parallel-size", "2"])
LAYOUTS = {"tp2-pp2": ("dense", [*TP2, *PP2], 4), "dp2": ("dense", [], 2),
           "ep2": ("moe", ["--expert-model-parallel-size", "2"], 2), "tp2-cp2": ("dense", [*TP2, *CP2], 4),
           "pp2-cp2": ("dense", [*PP2, *CP2], 4),
           # experts over the 2 data-parallel x 2 context-parallel ranks
           "cp2-dp2-ep2": ("moe", [*CP2, "--expert-model-parallel-size", "2"], 4)}
# A fine-tuning run reports both the perplexity and the exact match; the indexed one a perplexity streamed from .bin.
CASES = [("sft", "tp2-pp2"), ("sft", "dp2"), ("sft", "ep2"), ("indexed", "dp2"), ("indexed", "ep2"),
         ("sft", "tp2-cp2"), ("indexed", "pp2-cp2"), ("sft", "cp2-dp2-ep2")]


def _numbers(line: str) -> list[float]:
    return [float(number) for number in re.findall(r"\d+(?:\.\d+)?(?:E[-+]\d+)?", line)]


@pytest.mark.parametrize("run,layout", CASES, ids=[f"{run}-{layout}" for run, layout in CASES])
def test_every_layout_evaluates_as_one_process(data, tmp_path, capsys, run, layout):
    checkpoint, flags, world_size = LAYOUTS[layout]
    argv = ["--load", data[checkpoint], "--data-path", data["corpus" if run == "indexed" else "sft"], *RUNS[run]]
    assert main([*argv, "--output-file", str(tmp_path / "one.jsonl")]) == 0
    reported = ("evaluation |", "exact match:")
    expected = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(reported)]
    results = run_command_on_ranks(main, [*argv, "--output-file", str(tmp_path / "parallel.jsonl"), *flags],
                                   world_size=world_size)
    assert [code for code, _ in results] == [0] * world_size, results
    printed = [line for _, output in results for line in output.splitlines() if line.strip().startswith(reported)]
    assert len(printed) == len(expected) == (2 if run == "sft" else 1)  # rank 0 alone prints
    assert "loss tokens: " in expected[0] and "loss tokens: 0 " not in expected[0]
    for ours, theirs in zip(printed, expected):  # tensor parallelism rounds the loss otherwise: float32's floor
        assert _numbers(ours) == pytest.approx(_numbers(theirs), rel=1e-5)
    if run == "sft":
        one, parallel = ([json.loads(line) for line in open(tmp_path / name)] for name in ("one.jsonl",
                                                                                          "parallel.jsonl"))
        assert parallel == one and len(one) == 5


def test_a_model_that_cannot_split_its_sequences_is_refused_by_name(data, tmp_path, capsys):
    """A gated DeltaNet layer's scan runs from each position to the next: as training, evaluation refuses to
    split its sequences, in one line before any process group."""
    gated_delta_net = dict(experimental_attention_variant="gdn", linear_attention_freq="2", linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    load = _checkpoint(tmp_path, **gated_delta_net)
    assert main(["--load", load, "--data-path", data["corpus"], *CP2]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --context-parallel-size 2 with --experimental-attention-variant gdn")
    assert error.count("\n") == 1
