"""The entry point under torchrun prints the same losses as the single-process run (the parity ladder)."""
from megatron_lite import pretrain_gpt
from tests.distributed import run_command_on_ranks
from tools import loss_parity
from tools.loss_parity import Layout, max_relative_difference, run_layout

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "4", "--eval-interval", "100", "--eval-iters", "1", "--lr", "1e-3", "--no-log-memory"]
# The log prints 7 significant digits; the runs agree far beyond that but not bitwise.
RTOL = 2e-6


def test_ladder_tool_runs_tensor_and_pipeline_layouts_under_torchrun_within_rtol(capsys):
    """The tool as a user runs it, and the ladder's first rungs: tp2 and tp2-pp2 against one process."""
    code = loss_parity.main(["--layouts", "1x1x1", "2x1x1", "2x2x1", "--rtol", str(RTOL), "--", *FLAGS])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "control" in out and f"within rtol {RTOL:g}" in out, out
    assert "[1/3] running layout 1x1x1 on 1 process(es) ..." in err  # progress while runs take minutes
    assert "[3/3] layout 2x2x1: 4 iterations in " in err


def test_torchrun_matches_single_process_on_the_full_grid_with_the_distributed_optimizer_and_sp():
    extra = ["--use-distributed-optimizer", "--sequence-parallel"]
    control = run_layout(Layout(1, 1, 1), FLAGS, timeout=240)
    losses = run_layout(Layout.parse("2x2x2"), FLAGS + extra, timeout=240)
    assert len(control) == 4 and max_relative_difference(control, losses) <= RTOL, (control, losses)


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
