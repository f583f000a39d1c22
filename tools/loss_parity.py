"""Run the parity ladder: one control layout and others, same flags; print how far each drifts.

    python tools/loss_parity.py --layouts 1x1x1 2x1x1 2x2x2 -- --num-layers 4 --hidden-size 256 ... --mock-data

The first layout is the control. Exits 1 if any layout's losses differ from the control's by
more than --rtol (relative), so it can gate a cluster before a long run.
"""
import argparse
import sys
import time

from megatron_lite.cli.parser import ArgumentParser
from megatron_lite.process_groups.failures import run_command
from megatron_lite.training.loss_parity import Layout, max_relative_difference, run_layout


def main(argv=None) -> int:
    return run_command(compare_layouts, argv)


def compare_layouts(argv) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--layouts", nargs="+", type=Layout.parse, required=True, help="TPxPPxDP, control first")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the training flags shared by every run")
    args = parser.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    control, *others = args.layouts
    try:
        return _compare(control, others, flags, args.rtol)
    except RuntimeError as error:  # a run failed or logged no loss: the ladder cannot pass
        print(f"loss parity FAILED: {error}", file=sys.stderr)
        return 1


def _compare(control: Layout, others: list[Layout], flags: list[str], rtol: float) -> int:
    total = len(others) + 1
    reference = _run_with_progress(control, flags, 1, total)
    print(f"{'layout':>8} {'ranks':>5} {'iterations':>10} {'max rel diff':>12}  losses")
    print(f"{str(control):>8} {control.world_size:5d} {len(reference):10d} {'control':>12}  {reference}")
    worst = 0.0
    for number, layout in enumerate(others, start=2):
        losses = _run_with_progress(layout, flags, number, total)
        difference = max_relative_difference(reference, losses)
        worst = max(worst, difference)
        print(f"{str(layout):>8} {layout.world_size:5d} {len(losses):10d} {difference:12.2e}  {losses}")
    print(f"worst relative difference {worst:.2e} ({'within' if worst <= rtol else 'ABOVE'} rtol {rtol:g})")
    return 0 if worst <= rtol else 1



def _run_with_progress(layout: Layout, flags: list[str], number: int, total: int) -> list[float]:
    """Each run can take minutes: say which is running, and how long it took (on stderr, beside the table)."""
    print(f"[{number}/{total}] running layout {layout} on {layout.world_size} process(es) ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    losses = run_layout(layout, flags)
    print(f"[{number}/{total}] layout {layout}: {len(losses)} iterations in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    return losses


if __name__ == "__main__":
    sys.exit(main())
