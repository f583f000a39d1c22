"""The entry point on every layout prints the same losses as the single-process run (the parity ladder).

The ladder tool runs as a user runs it, its layouts under a real torchrun; the layouts up to the full grid
run the command's ``main`` on forked ranks (``run_command_on_ranks``), where a world of 8 costs no
interpreter start-up per rank.
"""
import pytest

from megatron_lite import pretrain_gpt
from tests.distributed import run_command_on_ranks
from tools import loss_parity
from tools.loss_parity import DETERMINISTIC_FLAGS, LOSS_PATTERN, Layout, max_relative_difference

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "4", "--eval-interval", "100", "--eval-iters", "1", "--lr", "1e-3", "--no-log-memory"]
# The log prints 7 significant digits; the runs agree far beyond that but not bitwise.
RTOL = 2e-6


def _losses(layout: Layout, extra: list[str]) -> list[float]:
    """The lm loss the command logs at ``layout`` (tools/loss_parity's flags), its ranks forked here."""
    argv = [*FLAGS, *extra, *DETERMINISTIC_FLAGS, "--tensor-model-parallel-size",
            str(layout.tensor_model_parallel_size), "--pipeline-model-parallel-size",
            str(layout.pipeline_model_parallel_size)]
    results = run_command_on_ranks(pretrain_gpt.main, argv, world_size=layout.world_size)
    assert [code for code, _ in results] == [0] * layout.world_size, results
    return [float(loss) for loss in LOSS_PATTERN.findall(results[-1][1])]  # the last rank logs


@pytest.fixture(scope="module")
def single_process_losses():
    losses = _losses(Layout(1, 1, 1), [])
    assert len(losses) == 4
    return losses


@pytest.mark.parametrize("layout, extra", [
    ("2x2x1", []),
    ("2x2x2", ["--use-distributed-optimizer", "--sequence-parallel"]),
], ids=["tp2-pp2", "tp2-pp2-dp2-distopt-sp"])
def test_the_command_matches_single_process(single_process_losses, layout, extra):
    losses = _losses(Layout.parse(layout), extra)
    assert max_relative_difference(single_process_losses, losses) <= RTOL, (single_process_losses, losses)


def test_ladder_tool_under_torchrun_reports_and_gates(capsys):
    """The tool as a user runs it: context parallelism (cp2, TPxPPxDPxCP) under a real torchrun against one
    process; tensor and pipeline layouts run above."""
    code = loss_parity.main(["--layouts", "1x1x1", "1x1x1x2", "--rtol", str(RTOL), "--", *FLAGS])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "control" in out and f"within rtol {RTOL:g}" in out, out
    assert "[1/2] running layout 1x1x1 on 1 process(es) ..." in err  # progress while runs take minutes
    assert "[2/2] layout 1x1x1x2: 4 iterations in " in err
    assert Layout.parse("2x1x2x4").world_size == 16 and str(Layout.parse("2x2x1")) == "2x2x1"
    with pytest.raises(ValueError, match="TPxPPxDP or TPxPPxDPxCP"):
        Layout.parse("2x2")


def test_world_size_mismatch_fails_fast_with_the_arithmetic():
    results = run_command_on_ranks(pretrain_gpt.main, [*FLAGS, "--tensor-model-parallel-size", "2"], world_size=3)
    assert [code for code, _ in results] == [2, 2, 2]
    output = "".join(output for _, output in results)
    assert output.count("error:") == 1 and "world size 3 is not divisible by --tensor-model-parallel-size (2)" in output


def test_ladder_tool_fails_when_no_loss_was_logged(capsys):
    # --train-iters 0 exits cleanly without a log line: zero losses compared must not read as agreement.
    code = loss_parity.main(["--layouts", "1x1x1", "1x1x1", "--", *FLAGS, "--train-iters", "0",
                             "--lr-decay-iters", "4"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "loss parity FAILED" in err and "printed no '| lm loss: ... |' line" in err
    assert "within rtol" not in out
    assert max_relative_difference([], []) == float("inf")
