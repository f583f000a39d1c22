"""Print which node, tensor, pipeline, data and context-parallel rank every process gets (and, for a
mixture of experts, its expert-model, expert-tensor and expert-data-parallel rank).

The launch scripts call this for ``--dry-run``, so a layout is checked before a
job waits in the queue: the training flags are parsed and validated exactly as
``megatron_lite.pretrain_gpt`` would, and the rank arithmetic is
``RankLayout``'s, not a copy.

    python tools/print_rank_map.py --nnodes 2 --nproc-per-node 8 \\
        --hostnames gpu001 gpu002 -- --tensor-model-parallel-size 4 ...

Both torchrun and srun (block distribution) give each node a contiguous run of
ranks, so global rank r lives on node r // nproc_per_node.
"""
from __future__ import annotations

import sys

from megatron_lite.cli.arguments import parse_args
from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.config import Config, ConfigError
from megatron_lite.process_groups.failures import run_command
from megatron_lite.process_groups.parallel_state import RankLayout


def rank_map(nnodes: int, nproc_per_node: int, tensor_model_parallel_size: int,
             pipeline_model_parallel_size: int, context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
             expert_tensor_parallel_size: int | None = None) -> list[dict]:
    """One row per global rank: rank, node, local_rank, tp, pp, dp, cp, and its expert coordinates ep, etp, edp."""
    layout = RankLayout(nnodes * nproc_per_node, tensor_model_parallel_size, pipeline_model_parallel_size,
                        context_parallel_size=context_parallel_size,
                        expert_model_parallel_size=expert_model_parallel_size,
                        expert_tensor_parallel_size=expert_tensor_parallel_size)
    rows = []
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        rows.append({"rank": rank, "node": rank // nproc_per_node, "local_rank": rank % nproc_per_node,
                     "tp": coords["tensor"], "pp": coords["pipeline"], "dp": coords["data"],
                     "cp": coords["context"], "ep": coords["expert_model"], "etp": coords["expert_tensor"],
                     "edp": coords["expert_data"]})
    return rows


def layout_warnings(nproc_per_node: int, tensor_model_parallel_size: int) -> list[str]:
    """Layouts that run but run slowly."""
    if tensor_model_parallel_size > nproc_per_node or nproc_per_node % tensor_model_parallel_size:
        return [f"tensor-parallel groups of {tensor_model_parallel_size} cross node boundaries "
                f"({nproc_per_node} processes per node): their all-reduces leave NVLink; keep "
                f"--tensor-model-parallel-size a divisor of the GPUs per node."]
    return []


def format_rank_map(rows: list[dict], config: Config, hostnames: list[str]) -> str:
    parallel = config.parallel
    tp, pp, cp = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.context_parallel_size)
    world = len(rows)
    nnodes = rows[-1]["node"] + 1
    dp = world // (tp * pp * cp)
    experts = config.model.num_experts is not None
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_size
    expert_text = (f"; experts: expert-tensor {etp} x expert-model {ep} x expert-data {world // (pp * ep * etp)} "
                   f"per pipeline stage" if experts else "")
    columns = ("tp", "pp", "dp", "cp") + (("ep", "etp", "edp") if experts else ())
    lines = [f"rank map: {world} processes on {nnodes} node(s) = tensor-parallel {tp} x pipeline-parallel {pp} "
             f"x data-parallel {dp} x context-parallel {cp}{expert_text}; {config.training.num_microbatches(dp)} "
             f"micro-batch(es) per iteration",
             f"{'rank':>6}  {'node':<16} {'local_rank':>10}" + "".join(f" {c:>4}" for c in columns)]
    for row in rows:
        host = hostnames[row["node"]] if row["node"] < len(hostnames) else f"node{row['node']}"
        lines.append(f"{row['rank']:>6}  {host:<16} {row['local_rank']:>10}" + "".join(f" {row[c]:>4}"
                                                                                      for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_command(print_rank_map, sys.argv[1:] if argv is None else argv)


def print_rank_map(argv: list[str]) -> None:
    own, training = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--hostnames", nargs="*", default=[], help="node names in node-rank order")
    args = parser.parse_args(own)
    if args.nnodes < 1 or args.nproc_per_node < 1:
        raise ConfigError(f"--nnodes ({args.nnodes}) and --nproc-per-node ({args.nproc_per_node}) must be >= 1.")
    config = parse_args(training)
    parallel = config.parallel
    parallel.data_parallel_size(args.nnodes * args.nproc_per_node)  # the flags' own check, naming them
    rows = rank_map(args.nnodes, args.nproc_per_node, parallel.tensor_model_parallel_size,
                    parallel.pipeline_model_parallel_size, parallel.context_parallel_size,
                    parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size)
    print(format_rank_map(rows, config, args.hostnames))
    for warning in layout_warnings(args.nproc_per_node, parallel.tensor_model_parallel_size):
        print(f"warning: {warning}")


if __name__ == "__main__":
    sys.exit(main())
