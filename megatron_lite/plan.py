"""Entry point: ``python -m megatron_lite.plan [pretraining flags] [cluster flags]``.

Size a run before you have the machine. Give the model the way pretraining takes it
(the same flags; or ``--use-checkpoint-args --load DIR``; or ``--hf-config PATH``), the
global batch, and a cluster (``--cluster`` preset and/or its numbers). With any layout
flag (``--tensor-model-parallel-size``, ``--micro-batch-size``, ``--recompute-granularity``,
...) the planner estimates that layout; without one it tries every valid layout and
ranks them by estimated step time (the pipeline bubble included), marking those that do
not fit. ``--json`` prints the same as one JSON object. The models behind the numbers:
``megatron_lite/planner/``.

    python -m megatron_lite.plan --cluster a100-80g --num-gpus 1024 --bf16 --num-layers 96 \\
        --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --vocab-size 50257 \\
        --global-batch-size 1536 --overlap-grad-reduce
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import build_parser, config_from_namespace
from megatron_lite.planner.cluster import PRESETS, customise
from megatron_lite.planner.estimate import estimate
from megatron_lite.planner.layouts import Layout, check_layout, enumerate_layouts
from megatron_lite.planner.report import format_estimate, format_ranking, rank, ranking_dict
from megatron_lite.process_groups.failures import run_command

# Flags that choose a layout: any of them means "estimate this one".
LAYOUT_FIELDS = {"tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size",
                 "num_layers_per_virtual_pipeline_stage", "micro_batch_size", "sequence_parallel",
                 "recompute_granularity", "recompute_method", "recompute_num_layers", "use_distributed_optimizer",
                 "data_parallel_sharding_strategy"}
CLUSTER_FIELDS = ("num_gpus", "gpus_per_node", "gpu_memory_gb", "gpu_peak_tflops", "intra_node_bandwidth_gbps",
                  "inter_node_bandwidth_gbps", "matmul_efficiency", "memory_allowance_gb")
PLANNER_FIELDS = set(CLUSTER_FIELDS) | {"cluster", "tensor_parallel_across_nodes", "hf_config", "top", "json"}


def build_plan_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = "python -m megatron_lite.plan"
    parser.description = __doc__.split("\n\n")[1]
    group = parser.add_argument_group("planner")
    group.add_argument("--cluster", choices=[*PRESETS, "local"], default="h100-80g",
                       help="hardware preset (documented numbers, each overridable), or 'local' to measure this "
                            "machine as --num-gpus gloo processes (default: h100-80g)")
    group.add_argument("--num-gpus", type=int, help="GPUs in the cluster (default: one node)")
    group.add_argument("--gpus-per-node", type=int)
    group.add_argument("--gpu-memory-gb", type=float)
    group.add_argument("--gpu-peak-tflops", type=float, help="dense matmul peak in the training dtype")
    group.add_argument("--intra-node-bandwidth-gbps", type=float,
                       help="per GPU and direction, gigabits/s (NVLink 4: 450 GB/s = 3600)")
    group.add_argument("--inter-node-bandwidth-gbps", type=float, help="per GPU, gigabits/s (NDR InfiniBand: 400)")
    group.add_argument("--matmul-efficiency", type=float,
                       help="fraction of the peak a transformer layer sustains (default per preset, measured locally)")
    group.add_argument("--memory-allowance-gb", type=float,
                       help="memory beyond the model's: CUDA context, communication buffers, fragmentation")
    group.add_argument("--tensor-parallel-across-nodes", action="store_true",
                       help="also consider tensor-parallel groups larger than a node")
    group.add_argument("--hf-config", help="take the model from a Hugging Face config.json (or its directory); "
                                           "model flags given override it")
    group.add_argument("--top", type=int, default=20, help="layouts to list when ranking (default: 20)")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def _with_hf_model(namespace: dict, path: str) -> dict:
    """The model of a Hugging Face config.json, for the model flags the command line leaves out."""
    from megatron_lite.interop.hf.weights import model_config_from_hf

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(path):
        raise ConfigError(f"--hf-config {path}: the file or directory does not exist.")
    if not os.path.isfile(file):
        raise ConfigError(f"--hf-config {path}: no config.json there.")
    with open(file) as f:
        model = dataclasses.asdict(model_config_from_hf(json.load(f)))
    merged = {**model, **namespace}
    merged["group_query_attention"] = namespace["group_query_attention"] or "num_query_groups" not in namespace
    return merged


def parse_plan_args(argv: list[str] | None = None):
    """-> (config, planner options dict, whether a layout was given)."""
    namespace = vars(build_plan_parser().parse_args(argv))
    planner = {k: namespace.pop(k, None) for k in PLANNER_FIELDS}
    layout_given = bool(LAYOUT_FIELDS & set(namespace))  # else every layout and sharding strategy is ranked
    if planner["hf_config"]:
        namespace = _with_hf_model(namespace, planner["hf_config"])
    if not (namespace.get("data_path") or namespace.get("train_data_path")):
        namespace["mock_data"] = True  # the planner reads no data; pretraining's check wants a source
    return config_from_namespace(namespace), planner, layout_given


def _cluster(config, planner: dict):
    dtype = "bf16" if config.training.bf16 else "fp16" if config.training.fp16 else "fp32"
    options = {k: planner[k] for k in CLUSTER_FIELDS}
    if planner["cluster"] == "local":
        from megatron_lite.planner.calibrate import calibrate_local
        base = calibrate_local(config.model, config.params_dtype, config.training.micro_batch_size,
                               num_processes=planner["num_gpus"] or 2)
    else:
        base = PRESETS[planner["cluster"]]
    return customise(base, dtype=dtype, **options)


def plan(argv: list[str] | None = None) -> None:
    config, planner, layout_given = parse_plan_args(argv)
    cluster = _cluster(config, planner)
    model = dataclasses.asdict(config.model)
    if layout_given:
        layout = Layout(config, cluster.num_gpus)
        check_layout(layout, cluster, tensor_parallel_across_nodes=True)  # asked for: estimated as asked
        result = estimate(layout, cluster)
        print(json.dumps({**result.as_dict(), "cluster": cluster.name, "model": model}, indent=2)
              if planner["json"] else format_estimate(result))
        return
    layouts = enumerate_layouts(config, cluster, tensor_parallel_across_nodes=planner["tensor_parallel_across_nodes"])
    ranked = rank([estimate(layout, cluster) for layout in layouts])
    if not ranked:
        raise ConfigError(f"no valid layout of this model and --global-batch-size on {cluster.num_gpus} GPUs: "
                          f"check that the batch divides over the data-parallel sizes.")
    print(json.dumps({**ranking_dict(ranked, planner["top"]), "model": model}, indent=2)
          if planner["json"] else format_ranking(ranked, planner["top"]))


def main(argv: list[str] | None = None) -> int:
    return run_command(plan, argv)


if __name__ == "__main__":
    sys.exit(main())
