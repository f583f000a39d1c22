"""What the planner prints: one layout in detail, or layouts ranked by step time; or the same as JSON."""
from __future__ import annotations

from megatron_lite.config import Config, ModelConfig
from megatron_lite.model.builder import count_parameters
from megatron_lite.planner.cluster import Cluster
from megatron_lite.planner.estimate import Estimate
from megatron_lite.planner.memory import GB
from megatron_lite.planner.parameters import active_parameters
from megatron_lite.planner.step_time import training_dtype

TIME_PARTS = {"compute": "compute (recomputation included)", "tensor_parallel": "tensor-parallel communication",
              "context_parallel": "context-parallel exchange, exposed",
              "pipeline_p2p": "pipeline send/receive", "expert_parallel": "expert-parallel all-to-all",
              "pipeline_bubble": "pipeline bubble",
              "data_parallel": "data-parallel communication, exposed", "optimizer": "optimizer step"}


def seconds_text(seconds: float) -> str:
    """Three decimals; three significant digits below 0.1 s, so a tiny model's step does not print as 0.000."""
    return f"{seconds:.3f}" if seconds >= 0.1 or seconds == 0 else f"{seconds:.3g}"


def describe_model(model: ModelConfig) -> str:
    kind = "Llama-style" if model.swiglu else "GPT"
    groups = f", {model.num_query_groups} query groups" if model.num_query_groups != model.num_attention_heads else ""
    total = count_parameters(Config(model=model)).total
    experts = ""
    if model.num_experts is not None:
        moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
        experts = (f", {model.num_experts} experts of ffn {model.moe_ffn_hidden_size} (top {model.moe_router_topk}) in "
                   f"{moe_layers} layers")
    active = f" ({active_parameters(model, total) / 1e9:.2f} B active per token)" if experts else ""
    return (f"{kind} model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads"
            f"{groups}, ffn {model.ffn_hidden_size}{experts}, sequence {model.seq_length}, vocabulary "
            f"{model.vocab_size}, {total / 1e9:.2f} B parameters{active}")


def describe_cluster(cluster: Cluster, dtype: str) -> str:
    return (f"cluster {cluster.name}: {cluster.num_gpus} GPUs, {cluster.gpus_per_node} per node, "
            f"{cluster.gpu_memory_gb:g} GB each, {cluster.peak(dtype):g} TFLOP/s {dtype} peak at matmul efficiency "
            f"{cluster.matmul_efficiency:.2f}, in-node {cluster.intra_node.bandwidth_gbps:g} Gb/s, "
            f"between nodes {cluster.inter_node.bandwidth_gbps:g} Gb/s")


def format_estimate(estimate: Estimate) -> str:
    layout, memory, time = estimate.layout, estimate.memory, estimate.time
    static = memory.static
    d = layout.as_dict()
    host = " (in host memory)" if static.optimizer_state_on_host else ""
    gradients_host = f" ({static.host_gradient_bytes / GB:.2f} in host memory)" if static.host_gradient_bytes else ""
    fits = "fits" if estimate.fits else "does NOT fit"
    lines = [describe_model(layout.config.model), describe_cluster(estimate.cluster, training_dtype(layout)),
             f"layout: tensor {d['tensor_model_parallel_size']} x context {d['context_parallel_size']} x pipeline "
             f"{d['pipeline_model_parallel_size']} (virtual {d['virtual_pipeline_model_parallel_size']}) x data "
             f"{d['data_parallel_size']}; micro-batch "
             f"{d['micro_batch_size']} x {d['num_microbatches']} per step, global batch {d['global_batch_size']}; "
             f"sequence parallel {'on' if d['sequence_parallel'] else 'off'}; recompute {d['recompute']}; "
             f"sharding {d['data_parallel_sharding_strategy']}",
             f"  flags: {layout.flags()}", "",
             f"memory per GPU, GB (fullest rank: pipeline stage {memory.pipeline_rank})",
             f"  parameters (at the peak of gathers){static.peak_parameter_bytes / GB:9.2f}",
             f"  gradients                          {static.gradient_bytes / GB:9.2f}{gradients_host}",
             f"  optimizer state                    {static.optimizer_state_bytes / GB:9.2f}{host}",
             *([f"  reference model (frozen)           {static.reference_bytes / GB:9.2f}"]
               if static.reference_bytes else []),
             *([f"  reference model, before training   {static.reference_pass_bytes / GB:9.2f}  (scores the run's "
                f"pairs, then freed)"] if static.reference_pass_bytes else []),
             f"  activations at the schedule's peak {memory.activation_bytes / GB:9.2f}",
             f"  loss working memory                {memory.loss_transient_bytes / GB:9.2f}",
             *([f"  optimizer step (Muon's matrices)   {memory.optimizer_step_bytes / GB:9.2f}  (once the "
                f"activations are freed)"] if memory.optimizer_step_bytes else []),
             f"  allowance (context, buffers)       {memory.allowance_bytes / GB:9.2f}",
             f"  total                              {memory.total_bytes / GB:9.2f} of "
             f"{estimate.cluster.gpu_memory_gb:g}: {fits}", "",
             "step time, s"]
    lines += [f"  {TIME_PARTS[k]:<35}{seconds_text(v):>9}" for k, v in time.breakdown.items()]
    lines += [f"  total                              {seconds_text(time.step_time_s):>9}  (bubble fraction "
              f"{time.bubble_fraction:.3f}, from the schedule tables)", "",
              f"throughput: {estimate.tokens_per_second:,.0f} tokens/s, {estimate.tflops_per_gpu:.1f} TFLOP/s per GPU, "
              f"MFU {100 * estimate.mfu:.1f}%"]
    return "\n".join(lines)


def _header(experts: bool) -> str:
    """The ranking's column titles; a mixture of experts' has its expert-parallel size (ep) too."""
    ep = f" {'ep':>3}" if experts else ""
    return (f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'vpp':>3}{ep} {'dp':>5} {'mbs':>3} {'m':>5} {'recompute':<10} "
            f"{'sharding':<18} "
            f"{'step s':>8} {'tokens/s':>10} {'TFLOP/s':>7} {'MFU':>6} {'bubble':>6} {'GB/GPU':>7}  fits")


def _row(index: int, estimate: Estimate, experts: bool) -> str:
    d = estimate.layout.as_dict()
    recompute = d["recompute"].split("/")[0]
    ep = f" {d['expert_model_parallel_size']:>3}" if experts else ""
    return (f"{index:>3} {d['tensor_model_parallel_size']:>3} {d['context_parallel_size']:>3} "
            f"{d['pipeline_model_parallel_size']:>3} {d['virtual_pipeline_model_parallel_size']:>3}{ep} "
            f"{d['data_parallel_size']:>5} {d['micro_batch_size']:>3} "
            f"{d['num_microbatches']:>5} {recompute:<10} {d['data_parallel_sharding_strategy']:<18} "
            f"{seconds_text(estimate.time.step_time_s):>8} {estimate.tokens_per_second:>10,.0f} "
            f"{estimate.tflops_per_gpu:>7.1f} "
            f"{100 * estimate.mfu:>5.1f}% {estimate.time.bubble_fraction:>6.3f} "
            f"{estimate.memory.total_bytes / GB:>7.1f}  {'yes' if estimate.fits else 'NO'}")


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Shortest step first (the pipeline bubble is part of it); among equally fast layouts the one
    needing less memory. Every layout runs the same global batch, so this is also by throughput."""
    return sorted(estimates, key=lambda e: (e.time.step_time_s, e.memory.total_bytes))


MISFITS_SHOWN = 5


def shown(ranked: list[Estimate], top: int) -> list[Estimate]:
    """The ``top`` fastest layouts that fit, and the (at most five) fastest that do not, if faster."""
    fitting = [e for e in ranked if e.fits][:top]
    slowest_shown = fitting[-1].time.step_time_s if fitting else float("inf")
    faster_misfits = [e for e in ranked if not e.fits and e.time.step_time_s <= slowest_shown][:MISFITS_SHOWN]
    return rank(fitting + faster_misfits)


def format_ranking(ranked: list[Estimate], top: int) -> str:
    first = ranked[0]
    dtype = training_dtype(first.layout)
    fitting = sum(e.fits for e in ranked)
    lines = [describe_model(first.layout.config.model), describe_cluster(first.cluster, dtype),
             f"{len(ranked)} valid layouts, {fitting} fit in memory; the {min(top, fitting)} fastest that fit, and "
             f"up to {MISFITS_SHOWN} faster ones that do not:", ""]
    experts = first.layout.config.model.num_experts is not None
    lines += [_header(experts)] + [_row(i + 1, e, experts) for i, e in enumerate(shown(ranked, top))]
    best = next((e for e in ranked if e.fits), None)
    lines += ["", f"best that fits: {best.layout.flags()}" if best else "no layout fits: add GPUs or memory"]
    return "\n".join(lines)


def ranking_dict(ranked: list[Estimate], top: int) -> dict:
    first = ranked[0]
    return {"num_layouts": len(ranked), "num_fitting": sum(e.fits for e in ranked),
            "cluster": first.cluster.name, "num_gpus": first.cluster.num_gpus,
            "layouts": [e.as_dict() for e in shown(ranked, top)]}
