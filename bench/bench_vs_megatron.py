"""Training iteration time of megatron_lite against Megatron-Core, same shapes, data and initial weights.

One whole iteration each: forward and backward over the global batch's micro-batches, the
data-parallel gradient reduction, clipping at 1.0 and an Adam step, fp32, on CPU with gloo. Ours
is the loop's own ``train_step`` (``training/loop.py``); Megatron-Core's is its ``GPTModel`` with
the local layer spec, its ``DistributedDataParallel``, its optimizer and its schedules, called as
Megatron-LM's ``train_step`` calls them (``bench/megatron_core_iteration.py``). Both train GPT-2
(LayerNorm, learned positions, tanh GeLU, biases, tied embeddings) and Llama (RMSNorm, RoPE,
SwiGLU, grouped-query attention, no biases, untied output layer) at four layouts: one process,
tp2, pp2 (1F1B, 4 micro-batches) and dp2 with the distributed optimizer; every layout trains the
same global batch of 4 micro-batches.

The same initial weights: ours are initialised once (one process, --seed 1234), saved, and exported
with our Megatron-LM converter (``tools/checkpoint_convert.py``'s exporter) at each layout's
tensor and pipeline sizes; each of our ranks loads the saved checkpoint (--pretrained-checkpoint),
each of Megatron's loads its rank file of the export with ``load_state_dict(strict=True)``, the
export's ``args`` giving Megatron's TransformerConfig. The first iteration's losses and gradient
norms, printed side by side, are then equal (to fp32 rounding).

Each side is a world of processes of its own (``side_by_side.Contender``: gloo, one rank per
process, ``--threads`` cores shared among the ranks) and the iterations alternate round by round;
the ratio is Megatron-Core's time over ours (> 1 = we are faster), min / median / max over rounds.

    # a snapshot of Megatron-LM and the few packages it imports (tools/make_megatron_fixtures.py's helper)
    python -c "import sys; sys.path.insert(0, 'tools'); import make_megatron_fixtures as m; \\
        print(m.Snapshots('/path/to/Megatron-LM/.git', '/tmp/mcore').pythonpath(m.CORE_017))"
    PYTHONPATH=$PWD:/tmp/mcore/deps python bench/bench_vs_megatron.py \\
        --megatron-lm /tmp/mcore/megatron-lm-core_v0.17.0 [--json FILE] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

import torch

# Run as a script, bench/ is on the path but the repository root is not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.side_by_side import Contender, Ratio, alternate, load_average, markdown_table  # noqa: E402

LAYERS, HIDDEN, HEADS, QUERY_GROUPS, SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 4, 256, 8, 2, 128, 2, 4, 4096
SEED = 1234
SHAPES = {
    "gpt2": dict(),  # our ModelConfig's defaults are GPT-2's
    "llama": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, num_query_groups=QUERY_GROUPS, norm_epsilon=1e-6,
                  ffn_hidden_size=4 * HIDDEN),
}
SHAPE_NAMES = {"gpt2": "GPT-2", "llama": "Llama"}


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_optimizer: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size


LAYOUTS = {layout.name: layout for layout in (
    Layout("1 process"), Layout("tp2", tensor_model_parallel_size=2), Layout("pp2", pipeline_model_parallel_size=2),
    Layout("dp2", data_parallel_size=2, distributed_optimizer=True))}


def our_config(shape: str, layout: Layout, checkpoint: str | None = None, save: str | None = None):
    from megatron_lite.config import (CheckpointConfig, Config, LoggingConfig, ModelConfig, OptimizerConfig,
                                      ParallelConfig, TrainingConfig)

    model = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                        max_position_embeddings=SEQ, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                        **SHAPES[shape])
    return Config(
        model=model, training=TrainingConfig(micro_batch_size=MICRO_BATCH, train_iters=10_000, seed=SEED,
                                             global_batch_size=MICRO_BATCH * MICRO_BATCHES),
        optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-4, lr_decay_style="constant", weight_decay=0.01, clip_grad=1.0),
        parallel=ParallelConfig(tensor_model_parallel_size=layout.tensor_model_parallel_size,
                                pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
                                use_distributed_optimizer=layout.distributed_optimizer),
        checkpoint=CheckpointConfig(pretrained_checkpoint=checkpoint, save=save),
        logging=LoggingConfig(log_memory=False))


def micro_batches() -> list:
    """The global batch: MICRO_BATCHES micro-batches of random tokens, the same for both sides."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        batches.append({"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                        "loss_mask": torch.ones(MICRO_BATCH, SEQ), "position_ids": torch.arange(SEQ).expand(
                            MICRO_BATCH, SEQ).contiguous()})
    return batches


def save_initial_weights(shape: str, directory: str) -> str:
    """Our model's initial weights (one process, --seed SEED) saved as a megatron_lite checkpoint; its root."""
    from megatron_lite.checkpointing import save_checkpoint
    from megatron_lite.checkpointing.training_state import TrainingState
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.training.loop import setup_model_and_optimizer

    root = os.path.join(directory, f"{shape}-ours")
    config = our_config(shape, LAYOUTS["1 process"], save=root)
    state = initialize_model_parallel(1, 1)
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, state)
    save_checkpoint(config, state, chunks, optimizer, scheduler, TrainingState())
    return root


def export_for_megatron(ours: str, layout: Layout, directory: str) -> str:
    """Our checkpoint as a legacy Megatron-LM checkpoint at ``layout``'s tensor and pipeline sizes."""
    from megatron_lite.interop.megatron.exporter import export_megatron_checkpoint

    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    save_dir = os.path.join(directory, f"{os.path.basename(ours)}-megatron-tp{tp}pp{pp}")
    if not os.path.isdir(save_dir):
        export_megatron_checkpoint(ours, save_dir, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return save_dir


def our_iteration(shape: str, layout: Layout, checkpoint: str, batches: list):
    """(one training iteration of megatron_lite on this rank, None) for this rank of ``layout``'s world."""
    import torch.distributed as dist

    from megatron_lite import checkpointing
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.training.loop import setup_model_and_optimizer, train_step

    config = our_config(shape, layout, checkpoint=checkpoint)
    if layout.world_size > 1:
        dist.init_process_group("gloo", init_method="env://")
    state = initialize_model_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size)
    chunks, optimizer, scheduler = setup_model_and_optimizer(config, state)
    checkpointing.load_checkpoint(config, state, chunks, optimizer, scheduler)
    per_rank = len(batches) // layout.data_parallel_size
    mine = batches[state.data_parallel_rank * per_rank:(state.data_parallel_rank + 1) * per_rank]

    def iteration():
        loss, _, grad_norm = train_step(config, state, chunks, optimizer, scheduler, iter(mine), per_rank)
        return None if loss is None else {"loss": loss, "grad_norm": grad_norm}
    return iteration, None


def megatron_iteration(megatron_lm: str, export_dir: str, layout: Layout, batches: list):
    from bench import megatron_core_iteration

    return megatron_core_iteration.build(megatron_lm, export_dir, layout, batches)


def reported(results) -> dict:
    """The one rank's report of an iteration (the last pipeline stage's, which holds the loss)."""
    results = results if isinstance(results, list) else [results]
    return next(r for r in results if r is not None)


def compare(shape: str, layout: Layout, megatron_lm: str, directory: str, ours: str, rounds: int,
            threads: int) -> dict:
    """One row: per-round ratios and each side's first-iteration loss and gradient norm."""
    batches = micro_batches()
    export = export_for_megatron(ours, layout, directory)
    per_rank_threads = max(1, threads // layout.world_size)
    with Contender(megatron_iteration, megatron_lm, export, layout, batches, threads=per_rank_threads,
                   world_size=layout.world_size) as megatron, \
            Contender(our_iteration, shape, layout, ours, batches, threads=per_rank_threads,
                      world_size=layout.world_size) as our:
        first = {"megatron": reported(megatron()[1]), "ours": reported(our()[1])}  # also the warm-up round
        seconds, _ = alternate({"ours": our, "megatron": megatron}, rounds, warmup=0)
    return row(shape, layout, seconds, first)


def compare_all(megatron_lm: str, shapes: list, layouts: list, rounds: int, threads: int, *,
                progress: bool = False) -> list:
    """Every shape at every layout (names of SHAPES and LAYOUTS): a row each, printed as it is measured
    with ``progress``."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-megatron-") as directory:
        for shape in shapes:
            ours = save_initial_weights(shape, directory)
            for name in layouts:
                rows.append(compare(shape, LAYOUTS[name], megatron_lm, directory, ours, rounds, threads))
                if progress:
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def row(shape: str, layout: Layout, seconds: dict, first: dict) -> dict:
    """The bookkeeping of one comparison: ratios by wall clock and CPU time, median seconds, first losses."""
    return {"shape": shape, "layout": layout.name, "ratio": Ratio.of(seconds["ours"], seconds["megatron"]),
            "cpu_ratio": Ratio.of(seconds["ours"], seconds["megatron"], clock="cpu"),
            "ours_s": statistics.median(s.wall for s in seconds["ours"]),
            "megatron_s": statistics.median(s.wall for s in seconds["megatron"]), "first": first}


def summary(rows: list) -> dict:
    """The JSON: each "shape/layout" -> its median ratio (Megatron-Core's time / ours) with min and max, by
    wall clock and by CPU time, the median seconds, and each side's first-iteration loss and gradient norm."""
    def ratio(r: Ratio) -> dict:
        return {"median": r.median, "min": min(r.rounds), "max": max(r.rounds), "rounds": list(r.rounds)}
    return {f"{r['shape']}/{r['layout']}": {**ratio(r["ratio"]), "cpu_time": ratio(r["cpu_ratio"]),
                                            "ours_s": r["ours_s"], "megatron_s": r["megatron_s"],
                                            "first_iteration": r["first"]} for r in rows}


def table(rows: list) -> str:
    return markdown_table(
        ["shape", "layout", "Megatron-Core / ours (wall), min / median / max", "by CPU time",
         "median iteration, ours / Megatron-Core (s)", "first loss, ours / Megatron-Core",
         "first grad norm, ours / Megatron-Core"],
        [[SHAPE_NAMES[r["shape"]], r["layout"], r["ratio"], r["cpu_ratio"],
          f"{r['ours_s']:.3f} / {r['megatron_s']:.3f}",
          f"{r['first']['ours']['loss']:.6f} / {r['first']['megatron']['loss']:.6f}",
          f"{r['first']['ours']['grad_norm']:.6f} / {r['first']['megatron']['grad_norm']:.6f}"] for r in rows])


def header(threads: int, rounds: int) -> str:
    return (f"Training iteration: {LAYERS} layers x {HIDDEN} ({HEADS} heads; Llama {QUERY_GROUPS} key/value groups), "
            f"seq {SEQ}, {MICRO_BATCHES} micro-batches of {MICRO_BATCH}, vocab {VOCAB}, fp32, gloo, {threads} "
            f"threads shared by the ranks, {rounds} alternating rounds; forward, backward, grad reduction, clip, Adam")


def check_megatron_lm(parser: argparse.ArgumentParser, directory: str) -> None:
    """Fail before any process starts when ``directory`` is no Megatron-LM source tree."""
    if not os.path.isfile(os.path.join(directory, "megatron", "core", "__init__.py")):
        parser.error(f"--megatron-lm {directory} holds no megatron/core/__init__.py: give the root of a Megatron-LM "
                     f"source tree (a checkout, or a git archive of a tag such as core_v0.17.0).")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, metavar="DIR", help="the root of a Megatron-LM source tree")
    parser.add_argument("--json", metavar="FILE", help="write the ratios to FILE")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="cores for each side, shared by its ranks")
    args = parser.parse_args(argv)
    check_megatron_lm(parser, args.megatron_lm)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}.")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(header(args.threads, args.rounds), flush=True)
    rows = compare_all(args.megatron_lm, args.shapes, args.layouts, args.rounds, args.threads, progress=True)
    print(table(rows))
    print(load_average())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary(rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
