"""Layers speak tensors, the command line speaks flags: a lower layer's error says what is wrong in its own
terms (shapes, group sizes), and config validation names the flag for the same user mistake first."""
import ast
import os

import pytest

from megatron_lite.cli.arguments import parse_args
from megatron_lite.config import ConfigError, ParallelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOWER_LAYERS = ["megatron_lite/tensor_parallel", "megatron_lite/context_parallel",
                "megatron_lite/pipeline_parallel/p2p.py",
                "megatron_lite/pipeline_parallel/schedule_table.py", "megatron_lite/pipeline_parallel/schedules.py",
                "megatron_lite/model/attention.py", "megatron_lite/expert_parallel", "megatron_lite/model/moe"]
BASE = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "8",
        "--vocab-size", "64", "--mock-data"]


def _modules():
    for entry in LOWER_LAYERS:
        path = os.path.join(ROOT, entry)
        if os.path.isdir(path):
            yield from (os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".py"))
        else:
            yield path


def _raised_text(node: ast.Raise) -> str:
    return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def test_lower_layers_raise_no_command_line_flags():
    named = [f"{os.path.relpath(path, ROOT)}:{node.lineno}" for path in _modules()
             for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.Raise)
             and "--" in _raised_text(node)]
    assert named == [], f"errors below config that name flags (say it in tensors; let config name the flag): {named}"


def test_the_interleaved_micro_batch_count_in_tensors_below_and_in_flags_above():
    from megatron_lite.pipeline_parallel.schedule_table import check_interleaved_microbatches

    with pytest.raises(ValueError, match="3 micro-batches is not a multiple of 2 stages"):
        check_interleaved_microbatches(3, 2)
    parallel = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match=r"micro-batches \(--global-batch-size / .* = 3\) to be a multiple of "
                                          r"--pipeline-model-parallel-size \(2\)"):
        parallel.check_interleaved_microbatches(3)
    ParallelConfig(pipeline_model_parallel_size=2).check_interleaved_microbatches(3)  # 1F1B takes any count


@pytest.mark.parametrize("extra, flag", [
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),  # the schedule's "at least one micro-batch"
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "9", "--max-position-embeddings",
      "16"], r"--seq-length \(9\) must be divisible by --tensor-model-parallel-size \(2\)"),  # p2p, reduce-scatter
    (["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"],
     r"--num-query-groups \(1\) must be divisible by --tensor-model-parallel-size \(2\)"),  # attention
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"],
     r"--ffn-hidden-size \(33\) must be divisible by --tensor-model-parallel-size \(2\)"),  # ColumnParallelLinear
    (["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "2"],
     "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1"),  # the schedule table
    (["--context-parallel-size", "3", "--attention-dropout", "0"],
     r"--seq-length \(8\) must be divisible by 6"),  # context_parallel.local_positions
])
def test_the_command_line_names_the_flag_for_each_mistake_a_layer_would_meet(extra, flag):
    with pytest.raises(ConfigError, match=flag):
        parse_args(BASE + extra)
