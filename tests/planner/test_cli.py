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


def _moe_config(name: str) -> dict:
    """A small config.json of each mixture-of-experts family (a Qwen3-MoE with a dense first layer)."""
    import transformers

    small = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 max_position_embeddings=4096, num_experts_per_tok=2)
    config = {"mixtral": lambda: transformers.MixtralConfig(**small, intermediate_size=1024, num_local_experts=8),
              "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
                  **small, intermediate_size=1024, moe_intermediate_size=256, num_experts=8, mlp_only_layers=[0]),
              "olmoe": lambda: transformers.OlmoeConfig(**small, intermediate_size=256, num_experts=8)}[name]()
    return {**config.to_dict(), "model_type": config.model_type}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_mixture_of_experts_from_hugging_face_configs(tmp_path, capsys, family):
    """A mixture of experts' layouts are ranked over expert parallelism too; one layout's parameters per GPU are
    its experts over ep, the rest whole."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(_moe_config(family)))
    common = ["--hf-config", str(tmp_path), "--seq-length", "1024", "--global-batch-size", "16", "--bf16"]
    code, out, _ = _run(capsys, *common, "--num-gpus", "8", "--json", "--top", "500")
    assert code == 0
    ranked = json.loads(out)["layouts"]
    assert {entry["layout"]["expert_model_parallel_size"] for entry in ranked} == {1, 2, 4, 8}
    assert all(entry["time_breakdown_s"]["expert_parallel"] > 0 for entry in ranked
               if entry["layout"]["expert_model_parallel_size"] > 1)
    whole, split = (json.loads(_run(capsys, *common, "--num-gpus", "4", "--micro-batch-size", "1",
                                    "--expert-model-parallel-size", ep, "--json")[1]) for ep in ("1", "4"))
    config = _moe_config(family)
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    experts_bytes = (3 if family == "qwen3_moe" else 4) * 8 * 3 * 512 * width * 2  # MoE layers x E x 3 h F, bf16
    assert split["memory"]["parameters_gb"] == pytest.approx(
        whole["memory"]["parameters_gb"] - experts_bytes * (1 - 1 / 4) / GB)


def test_parameters_total_and_active_are_the_published_ones(tmp_path):
    """Mixtral 8x7B: 46.7 B parameters, 12.9 B active per token; OLMoE-1B-7B: 6.9 B, 1.3 B (their papers); gpt-oss;
    Llama 4."""
    from megatron_lite.interop.hf.weights import model_config_from_hf
    from megatron_lite.planner.report import describe_model

    mixtral = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
               "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6}
    olmoe = {"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
             "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
             "num_experts_per_tok": 8, "max_position_embeddings": 4096}
    assert "46.70 B parameters (12.88 B active per token)" in describe_model(model_config_from_hf(mixtral))
    assert "6.92 B parameters (1.28 B active per token)" in describe_model(model_config_from_hf(olmoe))
    # gpt-oss-20b and -120b: 20.91 B and 116.83 B (OpenAI's model card), biases and sinks included; its active 3.61 B
    # and 5.13 B leave out the unembedding (201088 x 2880 = 0.58 B), which a token does pass through here.
    for layers, experts, expected in ((24, 32, "20.91 B parameters (4.19 B"), (36, 128, "116.83 B parameters (5.71 B")):
        gpt_oss = {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                   "head_dim": 64, "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8,
                   "num_local_experts": experts, "num_experts_per_tok": 4, "max_position_embeddings": 4096,
                   "sliding_window": 128}
        assert expected in describe_model(model_config_from_hf(gpt_oss))
    # Llama 4 Scout's and Maverick's language models: 107.77 B (transformers' Llama4ForCausalLM of Scout's text
    # config counts 107,769,861,120; Meta's 109 B takes the vision encoder in) and 400 B, 17 B active: a top-1 expert
    # and the shared expert in every MoE layer (Scout's 48 of 16 experts, Maverick's 24 of 128, dense MLPs between).
    llama4 = {"model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
              "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "num_experts_per_tok": 1, "max_position_embeddings": 4096}
    for experts, step, expected in ((16, 1, "107.77 B parameters (17.17 B active"),
                                    (128, 2, "400.71 B parameters (17.19 B active")):
        config = model_config_from_hf(dict(llama4, num_local_experts=experts, interleave_moe_layer_step=step))
        assert expected in describe_model(config)


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


def test_estimate_for_a_moe_pretraining_config():
    """The start-up line's estimate of a mixture of experts: rank 7 of tp2 x dp4 with ep2 holds expert replica 1."""
    config = Config(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                      vocab_size=256, swiglu=True, add_bias_linear=False, num_experts=4),
                    parallel=ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                            use_distributed_optimizer=True),
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=8))
    assert estimate_for_config(config, 8, rank=7, device="cpu") == rank_memory(
        Layout(config, 8), device="cpu", pipeline_rank=0, data_parallel_rank=3, expert_data_parallel_rank=1)


def test_local_cluster_is_this_machine_measured(capsys):
    """--cluster local starts 2 gloo processes, measures them, and plans on what it found."""
    code, out, err = _run(capsys, "--cluster", "local", "--num-layers", "2", "--hidden-size", "128",
                          "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "512",
                          "--global-batch-size", "4", "--micro-batch-size", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["cluster"] == "local" and result["layout"]["data_parallel_size"] == 2
    assert 0 < result["mfu"] <= 1 and result["time_breakdown_s"]["data_parallel"] > 0
