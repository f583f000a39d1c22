"""Training curves of one or several runs, side by side, as a PNG.

    python tools/plot_training.py run1.log run2/tensorboard --labels baseline zero3 --output curves.png

Each RUN is the log of ``pretrain_gpt`` (its standard output, saved) or a ``--tensorboard-dir``. The
figure has four panels: loss (training, and validation as points), learning rate, grad norm and
throughput (tokens per second), against iterations or, with ``--x tokens``, tokens consumed (the log's
``consumed tokens``, which leave out fine-tuning's padding; in a log that lacks them, consumed samples x the
sequence length its start-up summary states; or TensorBoard's ``consumed tokens``). Needs matplotlib
(``pip install "megatron_lite[plot]"``); TensorBoard directories need tensorboard.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from megatron_lite.cli.parser import ArgumentParser

PANELS = (("lm loss", "loss"), ("learning rate", "learning rate"), ("grad norm", "grad norm"),
          ("tokens per second", "tokens per second"))
VALIDATION = "lm loss validation"
_NUMBER = r"([-+0-9.eEinfa]+)"
_ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|")
_FIELDS = {"learning rate": re.compile(rf" learning rate: {_NUMBER} \|"),
           "lm loss": re.compile(rf" lm loss: {_NUMBER} \|"), "grad norm": re.compile(rf" grad norm: {_NUMBER} \|")}
_THROUGHPUT = re.compile(rf"^ tokens per second: {_NUMBER} \|(?: consumed tokens: (\d+) \|)?")
_VALIDATION = re.compile(rf"^ validation loss at iteration (\d+) \| lm loss value: {_NUMBER} \|")
_BATCH = re.compile(r"^ batch: (\d+) sequences = .*?; (\d+) tokens per iteration")


class PlotError(ValueError):
    """A run that cannot be read; the message names it."""


def read_log(path: str) -> dict:
    """{scalar name: [(iteration, value), ...]} from a pretrain_gpt log, with "consumed tokens" when its
    throughput lines or its start-up summary (the sequence length) give them."""
    series, samples, tokens, seq_length, iteration = {}, [], [], None, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if (batch := _BATCH.search(line)) and seq_length is None:
                seq_length = int(batch.group(2)) // int(batch.group(1))
            if match := _ITERATION.search(line):
                iteration = int(match.group(1))
                samples.append((iteration, int(match.group(2))))
                for name, pattern in _FIELDS.items():
                    if value := pattern.search(line):
                        series.setdefault(name, []).append((iteration, float(value.group(1))))
            elif (value := _THROUGHPUT.search(line)) and iteration is not None:
                series.setdefault("tokens per second", []).append((iteration, float(value.group(1))))
                if value.group(2) is not None:
                    tokens.append((iteration, int(value.group(2))))
            elif value := _VALIDATION.search(line):
                series.setdefault(VALIDATION, []).append((int(value.group(1)), float(value.group(2))))
    if not samples:
        raise PlotError(f"{path} holds no iteration lines of pretrain_gpt (' iteration N/M | consumed samples: ...').")
    if tokens:
        series["consumed tokens"] = tokens
    elif seq_length is not None:  # a log from before the throughput line gave them
        series["consumed tokens"] = [(i, s * seq_length) for i, s in samples]
    return series


def read_tensorboard(directory: str) -> dict:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise PlotError(f"reading the TensorBoard directory {directory} needs tensorboard: pip install "
                        "tensorboard.") from None
    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    series = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
              for tag in accumulator.Tags()["scalars"]}
    if "lm loss" not in series:
        raise PlotError(f"{directory} holds no 'lm loss' scalars: is it a --tensorboard-dir of pretrain_gpt?")
    return series


def read_run(path: str) -> dict:
    if os.path.isdir(path):
        return read_tensorboard(path)
    if not os.path.isfile(path):
        raise PlotError(f"{path} does not exist; give a pretrain_gpt log file or a --tensorboard-dir.")
    return read_log(path)


def _against(series: dict, name: str, x: str) -> tuple[list, list]:
    points = series.get(name, [])
    if x == "iterations":
        return [i for i, _ in points], [v for _, v in points]
    tokens = dict(series["consumed tokens"])
    return [tokens[i] for i, _ in points if i in tokens], [v for i, v in points if i in tokens]


def plot(runs: list[tuple[str, dict]], output: str, x: str = "iterations") -> None:
    """Writes the four panels of every (label, series) run into the PNG ``output``."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError('plotting needs matplotlib: pip install "megatron_lite[plot]" (or pip install '
                        'matplotlib).') from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    for label, series in runs:
        if x == "tokens" and "consumed tokens" not in series:
            raise PlotError(f"--x tokens: {label} does not say how many tokens it consumed (a log without its "
                            "start-up summary); plot against iterations.")
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for axis, (name, title) in zip(axes.flat, PANELS):
        for index, (label, series) in enumerate(runs):
            color = f"C{index}"
            axis.plot(*_against(series, name, x), color=color, label=label)
            if name == "lm loss" and VALIDATION in series:
                axis.plot(*_against(series, VALIDATION, x), "o--", color=color, label=f"{label} (validation)")
        axis.set_title(title)
        axis.set_xlabel(x)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="pretrain_gpt log files or --tensorboard-dir folders")
    parser.add_argument("--labels", nargs="+", help="one name per run (default: the paths)")
    parser.add_argument("--output", default="training.png", help="the PNG to write (default: training.png)")
    parser.add_argument("--x", choices=("iterations", "tokens"), default="iterations", help="the horizontal axis")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels names {len(args.labels)} runs, but {len(args.runs)} are given")
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        runs = [(label, read_run(path)) for label, path in zip(args.labels or args.runs, args.runs)]
        plot(runs, args.output, args.x)
    except (PlotError, ValueError) as error:  # ConfigError (a flag) is a ValueError too
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
