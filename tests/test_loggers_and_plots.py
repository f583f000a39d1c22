"""TensorBoard and W&B (offline, no network) hold the scalars of the log lines, read back from their own files;
tools/plot_training.py draws a real run's log and TensorBoard directory into a PNG that is not blank."""
import contextlib
import glob
import importlib.util
import io
import json
import math
import re
import struct

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import parse_args
from megatron_lite.pretrain_gpt import main as pretrain_main
from tools.plot_training import main as plot_main
from tools.plot_training import read_log

RUN = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "4", "--log-interval", "1",
       "--eval-interval", "2", "--eval-iters", "1", "--lr", "1e-3", "--lr-warmup-iters", "2"]
LOGGED = ("lm loss", "learning rate", "grad norm", "loss scale", "tokens per second", "lm loss validation")


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One real run writing TensorBoard and offline W&B files; (its log file, the TensorBoard dir, the W&B dir)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("logged_run")
    with pytest.MonkeyPatch.context() as patch, _captured() as captured:
        for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
            patch.setenv(name, value)
        assert pretrain_main([*RUN, "--tensorboard-dir", str(root / "tb"), "--wandb-project", "megatron-lite-test",
                              "--wandb-exp-name", "tiny", "--wandb-save-dir", str(root / "wandb")]) == 0
    log = root / "train.log"
    log.write_text(captured.getvalue())
    return str(log), str(root / "tb"), str(root / "wandb")


@contextlib.contextmanager
def _captured():
    """stdout into a buffer: a module-scoped fixture cannot use capsys."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


def _logged_scalars(log: str) -> dict:
    """{name: {iteration: value}} from the log lines, at the precision they print."""
    series = read_log(log)
    text = open(log).read()
    series["loss scale"] = [(int(i), float(v)) for i, v in
                            re.findall(r" iteration\s+(\d+)/.*? loss scale: ([0-9.]+) \|", text)]
    return {name: dict(points) for name, points in series.items()}


def _assert_same(read_back: dict, logged: dict) -> None:
    for name in LOGGED:
        assert set(read_back[name]) == set(logged[name]) != set(), name
        for iteration, value in logged[name].items():
            # The log prints 7 significant digits (grad norm 3 decimals, tokens/s 1): compare at that precision.
            assert math.isclose(read_back[name][iteration], value, rel_tol=1e-5, abs_tol=0.05), (name, iteration)


def test_tensorboard_holds_the_scalars_of_the_log_lines(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, tensorboard_dir, _ = logged_run
    events = EventAccumulator(tensorboard_dir)
    events.Reload()
    read_back = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    _assert_same(read_back, _logged_scalars(log))
    assert read_back["consumed tokens"] == {i: 2 * 8 * i for i in range(1, 5)}
    assert set(read_back["number of skipped iterations"].values()) == {0}


def _wandb_records(path: str) -> list[bytes]:
    """The records of a W&B offline run file: LevelDB's log format (32 KiB blocks of records, each a 7-byte
    header of checksum, length and type: full, or first/middle/last pieces) after W&B's 7-byte file header."""
    data, position, records, piece = open(path, "rb").read(), 7, [], b""
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        piece += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, or last piece
            records.append(piece)
            piece = b""
    return records


def test_wandb_offline_holds_the_scalars_of_the_log_lines(logged_run):
    from wandb.proto import wandb_internal_pb2

    log, _, wandb_dir = logged_run
    (run_file,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    read_back, run_config = {}, {}
    for data in _wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.HasField("history"):
            for item in record.history.item:  # a key with spaces is stored as nested_key
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    read_back.setdefault(name, {})[record.history.step.num] = float(item.value_json)
        if record.HasField("run"):
            run_config.update({item.key or "/".join(item.nested_key): item.value_json
                               for item in record.run.config.update})
    _assert_same(read_back, _logged_scalars(log))
    assert json.loads(run_config["model"])["num_layers"] == 1  # the run records its whole config


def test_wandb_flags_without_a_project_are_one_error():
    with pytest.raises(ConfigError, match="which --wandb-project starts: add --wandb-project NAME"):
        parse_args([*RUN, "--wandb-exp-name", "tiny"])


def _ink(png: str) -> float:
    """The share of pixels that are not background white."""
    import matplotlib.image
    pixels = matplotlib.image.imread(png)[..., :3]
    return float((pixels.min(axis=-1) < 0.9).mean())


def test_the_plot_tool_draws_a_real_runs_log_and_tensorboard_dir(logged_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log, tensorboard_dir, _ = logged_run
    png = str(tmp_path / "curves.png")
    assert plot_main([log, tensorboard_dir, "--labels", "log", "tensorboard", "--x", "tokens", "--output", png]) == 0
    assert _ink(png) > 0.02  # four panels of axes, curves and legends; an empty figure is all white
    blank = str(tmp_path / "blank.png")
    import matplotlib.pyplot as plt
    plt.figure(figsize=(12, 8)).savefig(blank, dpi=100)
    assert _ink(blank) == 0.0
    assert plot_main([str(tmp_path / "missing.log"), "--output", png]) == 2
    assert "missing.log does not exist" in capsys.readouterr().err


# fp16 from a loss scale of 2^18 (hysteresis 1): iterations 1 and 2 overflow and are skipped, the scale halving to
# 2^16; iteration 6 overflows again. Nothing is NaN.
FP16_SKIPS = [*RUN[:RUN.index("--train-iters")], "--train-iters", "6", "--log-interval", "2", "--lr", "1e-3",
              "--fp16", "--initial-loss-scale", "262144", "--hysteresis", "1", "--no-log-memory"]


def test_fp16_skipped_iterations_log_no_loss_not_nan(tmp_path):
    """As Megatron-LM: a skipped iteration contributes no loss, and an interval in which none updated has no loss
    field (never ``nan`` when nothing is NaN); TensorBoard (and W&B, written from the same scalars) has no loss
    point there, and the plot tool reads the log."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_lite.training.loop import pretrain

    with _captured() as captured:
        state, _, _ = pretrain(parse_args([*FP16_SKIPS, "--tensorboard-dir", str(tmp_path / "tb")]))
    lines = [line for line in captured.getvalue().splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 3 and "lm loss: nan" not in captured.getvalue()
    assert "lm loss" not in lines[0] and "number of skipped iterations:   2 |" in lines[0]
    assert "number of skipped iterations:   0 |" in lines[1]
    # Iteration 6 was skipped: the interval's loss is iteration 5's alone, not the mean with 6's measured loss.
    assert "number of skipped iterations:   1 |" in lines[2] and f"lm loss: {state.losses[4]:.6E} |" in lines[2]
    assert state.skipped_iterations == 3 and state.nan_iterations == 0
    log = tmp_path / "train.log"
    log.write_text(captured.getvalue())
    assert [i for i, _ in read_log(str(log))["lm loss"]] == [4, 6]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [4, 6]
    assert {e.step: e.value for e in events.Scalars("number of skipped iterations")} == {2: 2, 4: 0, 6: 1}
    if importlib.util.find_spec("matplotlib"):
        assert plot_main([str(log), str(tmp_path / "tb"), "--output", str(tmp_path / "curves.png")]) == 0
