import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import print_pipeline_schedule  # noqa: E402


def test_timeline_bubble_and_in_flight(capsys):
    assert print_pipeline_schedule.main(["--pipeline-model-parallel-size", "2", "--num-microbatches", "2"]) == 0
    out = capsys.readouterr().out
    # Forward 1 tick, backward 2: stage 1 starts a tick late, stage 0 waits for the first gradient.
    assert "stage  0 | F0 F1  .  . B0 --  . B1 --\n" in out
    assert "stage  1 |  . F0 B0 -- F1 B1 --  .  .\n" in out
    assert "0.5000 from the table, 0.5000 = (p-1)/m in theory" in out
    assert "stage  0:   2  (bound 2)" in out and "stage  1:   1  (bound 1)" in out


def test_interleaved_ops_listing(capsys):
    assert print_pipeline_schedule.main(["--pipeline-model-parallel-size", "2", "--num-microbatches", "4",
                                         "--virtual-pipeline-model-parallel-size", "2", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "0.1250 from the table, 0.1250 = (p-1)/(v*m)" in out
    assert "stage  1: rF0.0 F0.0 sF0.0" in out


def test_bad_microbatch_count_is_reported(capsys):
    assert print_pipeline_schedule.main(["--pipeline-model-parallel-size", "4", "--num-microbatches", "6",
                                         "--virtual-pipeline-model-parallel-size", "2"]) == 2
    assert "--global-batch-size" in capsys.readouterr().err
