"""The closing line of a run (issue 42, item 5): a run shorter than --log-interval printed no loss at all."""
from megatron_lite.cli.arguments import parse_args
from megatron_lite.training import loop
from tests.test_training_loop import BASE

_AT = BASE.index("--log-interval")
SHORT = BASE[:_AT] + BASE[_AT + 2:] + ["--no-log-memory"]  # the default --log-interval, 100


def _closing_lines(out: str) -> list:
    return [line for line in out.splitlines() if line.startswith(" training finished:")]


def test_a_run_shorter_than_the_log_interval_ends_with_its_loss(tmp_path, capsys):
    state, _, _ = loop.pretrain(parse_args(SHORT + ["--train-iters", "3", "--save", str(tmp_path / "ckpt")]))
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if line.startswith(" iteration ")]  # 3 < --log-interval 100
    mean = sum(state.losses) / 3
    # 3 iterations of 4 sequences of 16 tokens
    assert _closing_lines(out) == [
        f" training finished: 3 iterations (1-3) | tokens: 192 | lm loss last: {state.losses[-1]:.6E}, mean: "
        f"{mean:.6E} over 3 iterations | time: " + _closing_lines(out)[0].split("time: ")[1]]

    # A resumed run sums up its own iterations, not those before the checkpoint.
    state, _, _ = loop.pretrain(parse_args(SHORT + ["--train-iters", "5", "--load", str(tmp_path / "ckpt"),
                                                  "--override-opt_param-scheduler"]))
    line, = _closing_lines(capsys.readouterr().out)
    assert line.startswith(f" training finished: 2 iterations (4-5) | tokens: 128 | lm loss last: "
                           f"{state.losses[-1]:.6E}, mean: {sum(state.losses[3:]) / 2:.6E} over 2 iterations |")


def test_a_run_with_nothing_to_do_prints_no_closing_line(tmp_path, capsys):
    loop.pretrain(parse_args(SHORT + ["--train-iters", "1", "--save", str(tmp_path / "ckpt")]))
    capsys.readouterr()
    loop.pretrain(parse_args(SHORT + ["--train-iters", "1", "--load", str(tmp_path / "ckpt")]))
    out = capsys.readouterr().out
    assert "nothing to do" in out and not _closing_lines(out)
