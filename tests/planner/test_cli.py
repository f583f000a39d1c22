"""``python -m megatron_lite.plan``: one layout or a ranking, as text or JSON; the start-up memory line."""
import json
import os
import subprocess
import sys

import pytest

from megatron_lite.config import Config, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.plan import main
from megatron_lite.planner.estimate import estimate_for_config, format_memory_estimate
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.memory import GB, rank_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
         "--vocab-size", "50257", "--bf16", "--global-batch-size", "64"]
KEYS = {"step_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu", "bubble_fraction", "layout"}


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_one_layout_as_json(capsys):
    code, out, _ = _run(capsys, *MODEL, "--cluster", "a100-80g", "--num-gpus", "16", "--pipeline-model-parallel-size",
                        "4", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert KEYS <= set(result)
    assert result["layout"] == {"tensor_model_parallel_size": 2, "context_parallel_size": 1,
                                "pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 1,
                                "data_parallel_size": 2,
                                "micro_batch_size": 2, "num_microbatches": 16, "global_batch_size": 64,
                                "sequence_parallel": False, "recompute": "none",
                                "data_parallel_sharding_strategy": "no_shard"}
    assert result["bubble_fraction"] == pytest.approx(3 / 16)
    assert result["memory_gb_per_gpu"] == pytest.approx(result["memory"]["total_gb"])
    assert result["tflops_per_gpu"] == pytest.approx(result["mfu"] * 312.0)
    assert sum(result["time_breakdown_s"].values()) == pytest.approx(result["step_time_s"])
    # Throughput is the model's FLOPs (Megatron's formula) over the step time; at tp 2 the
    # vocabulary pads to a multiple of 256: 50432.
    flops = 72 * 64 * 2048 * 8 * 1024 ** 2 * (1 + 2048 / (6 * 1024) + 50432 / (12 * 8 * 1024))
    assert result["tflops_per_gpu"] == pytest.approx(flops / result["step_time_s"] / 16 / 1e12)


def test_ranking_as_json_is_sorted_and_marks_misfits(capsys):
    big = [*MODEL, "--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32"]  # 3.4 B parameters
    code, out, _ = _run(capsys, *big, "--cluster", "a100-40g", "--num-gpus", "8", "--top", "5", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["num_layouts"] > result["num_fitting"] > 0
    layouts = result["layouts"]
    assert all(KEYS <= set(entry) for entry in layouts)
    speeds = [entry["tokens_per_second"] for entry in layouts]
    assert speeds == sorted(speeds, reverse=True)
    assert sum(entry["fits"] for entry in layouts) == 5
    for entry in layouts:
        assert entry["fits"] == (entry["memory_gb_per_gpu"] <= 40)


def test_ranking_as_text(capsys):
    code, out, _ = _run(capsys, *MODEL, "--cluster", "h100-80g", "--num-gpus", "8", "--top", "3")
    assert code == 0
    assert "valid layouts" in out and "best that fits: --tensor-model-parallel-size" in out
    assert len([line for line in out.splitlines() if line.rstrip().endswith(("yes", "NO"))]) >= 3


def test_one_layout_as_text(capsys):
    code, out, _ = _run(capsys, *MODEL, "--num-gpus", "8", "--recompute-granularity", "selective")
    assert code == 0
    assert "memory per GPU" in out and "pipeline bubble" in out and "MFU" in out


def test_a_zero3_layout_with_offloaded_gradients(capsys):
    """--data-parallel-sharding-strategy reaches the config like pretraining's other flags, so flags that
    need it (--grad-cpu-offload) plan too; ZeRO-3's gathers and host-memory shards show in the breakdown."""
    offload = ["--data-parallel-sharding-strategy", "optim_grads_params", "--grad-cpu-offload",
               "--optimizer-cpu-offload", "--overlap-grad-reduce", "--overlap-param-gather"]
    code, out, _ = _run(capsys, *MODEL, "--num-gpus", "8", "--micro-batch-size", "1", *offload, "--json")
    assert code == 0
    result = json.loads(out)
    memory = result["memory"]
    assert result["layout"]["data_parallel_sharding_strategy"] == "optim_grads_params"
    assert memory["peak_parameters_gb"] > memory["parameters_gb"] > 0
    assert 0 < memory["gradients_on_host_gb"] < memory["gradients_gb"]  # the staging buffers stay on the GPU
    device = (memory["peak_parameters_gb"] + memory["gradients_gb"] - memory["gradients_on_host_gb"]
              + memory["activations_gb"] + memory["loss_working_memory_gb"] + memory["allowance_gb"])
    assert memory["total_gb"] == pytest.approx(device)


def test_model_from_a_hugging_face_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 1376, "vocab_size": 32000, "max_position_embeddings": 4096}))
    code, out, _ = _run(capsys, "--hf-config", str(tmp_path), "--seq-length", "1024", "--group-query-attention",
                        "--num-query-groups", "2", "--global-batch-size", "8", "--num-gpus", "2",
                        "--micro-batch-size", "1", "--json")
    assert code == 0
    assert json.loads(out)["model"]["seq_length"] == 1024  # the command line wins over the file
    assert json.loads(out)["model"]["swiglu"] is True


# google/gemma-3-1b's config.json (transformers 4.50 spelling): local/global layers, two RoPE bases, q/k norms.
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 262144}


def test_gemma3_from_its_hugging_face_config(tmp_path, capsys):
    """Its parameters counted as transformers' Gemma3ForCausalLM of this config counts them (999,885,952, on the
    meta device), in fp32 bytes."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))
    code, out, _ = _run(capsys, "--hf-config", str(tmp_path), "--seq-length", "1024", "--global-batch-size", "8",
                        "--num-gpus", "2", "--micro-batch-size", "1", "--json")
    assert code == 0
    result = json.loads(out)
    assert round(result["memory"]["parameters_gb"] * GB) == 999_885_952 * 4
    assert (result["model"]["rotary_base_local"], result["model"]["window_attn_skip_freq"]) == (10000.0, 6)


@pytest.mark.parametrize("argv,message", [
    (["--tensor-model-parallel-size", "3"], "--num-attention-heads (16) must be divisible"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load or --pretrained-checkpoint"),
    (["--micro-batch-size", "3"], "--global-batch-size (64) must be divisible by --micro-batch-size (3)"),
])
def test_user_errors_name_the_flag(capsys, argv, message):
    code, _, err = _run(capsys, *MODEL, "--num-gpus", "16", *argv)
    assert code == 2 and message in err


def test_an_explicit_layout_may_cross_nodes_at_network_speed(capsys):
    """Enumeration keeps tensor parallelism in a node; a layout asked for is estimated as asked."""
    times = {}
    for tp in (8, 16):
        code, out, _ = _run(capsys, *MODEL, "--num-gpus", "16", "--tensor-model-parallel-size", str(tp), "--json")
        assert code == 0
        times[tp] = json.loads(out)["time_breakdown_s"]["tensor_parallel"]
    assert times[16] > 5 * times[8]


def test_tools_script_runs_the_cli():
    argv = [sys.executable, "tools/plan.py", *MODEL, "--num-gpus", "8", "--micro-batch-size", "1", "--json"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr
    assert KEYS <= set(json.loads(result.stdout))


def test_estimate_for_a_pretraining_config_and_its_log_line():
    config = Config(model=ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                                      vocab_size=256),
                    parallel=ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                            use_distributed_optimizer=True),
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=8))
    last = estimate_for_config(config, 8, rank=7, device="cpu")
    assert last == rank_memory(Layout(config, 8), device="cpu", pipeline_rank=1, data_parallel_rank=1)
    measured = {"parameter_bytes": 2 ** 20, "gradient_bytes": 2 ** 21, "optimizer_state_bytes": 3 * 2 ** 20}
    line = format_memory_estimate(last, measured)
    assert line.startswith(" planner estimate per rank (MB) | parameters: ")
    assert "(measured 1.0)" in line and "(measured 2.0)" in line and "(measured 3.0)" in line
    assert f"total: {last.total_bytes / 2 ** 20:.1f} |" in line
    assert last.total_bytes < 1 * GB


def test_local_cluster_is_this_machine_measured(capsys):
    """--cluster local starts 2 gloo processes, measures them, and plans on what it found."""
    code, out, err = _run(capsys, "--cluster", "local", "--num-layers", "2", "--hidden-size", "128",
                          "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "512",
                          "--global-batch-size", "4", "--micro-batch-size", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["cluster"] == "local" and result["layout"]["data_parallel_size"] == 2
    assert 0 < result["mfu"] <= 1 and result["time_breakdown_s"]["data_parallel"] > 0
