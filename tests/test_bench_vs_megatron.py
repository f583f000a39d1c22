"""bench/bench_vs_megatron.py's bookkeeping (ratios, the JSON, argument errors) and side_by_side's worlds of
ranks, without Megatron-LM; the real comparison when a Megatron-LM source tree is at hand (MEGATRON_LM)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch.distributed as dist

from bench import bench_vs_megatron as bench
from bench.side_by_side import Contender, Seconds


def _seconds(*walls):
    return [Seconds(wall, wall / 2) for wall in walls]


def test_the_json_maps_each_shape_and_layout_to_the_median_min_and_max_of_megatrons_time_over_ours():
    first = {"ours": {"loss": 8.1, "grad_norm": 2.0}, "megatron": {"loss": 8.1, "grad_norm": 2.0}}
    rows = [bench.row("gpt2", bench.LAYOUTS["tp2"], {"ours": _seconds(1.0, 2.0, 1.0),
                                                   "megatron": _seconds(1.5, 2.0, 3.0)}, first),
            bench.row("llama", bench.LAYOUTS["dp2"], {"ours": _seconds(2.0), "megatron": _seconds(1.0)}, first)]
    summary = json.loads(json.dumps(bench.summary(rows)))  # what --json writes
    assert list(summary) == ["gpt2/tp2", "llama/dp2"]
    gpt2 = summary["gpt2/tp2"]
    assert gpt2["rounds"] == [1.5, 1.0, 3.0]  # per round, Megatron-Core's time over ours
    assert (gpt2["min"], gpt2["median"], gpt2["max"]) == (1.0, 1.5, 3.0)
    assert gpt2["cpu_time"]["median"] == 1.5  # by each round's CPU time as well
    assert (gpt2["ours_s"], gpt2["megatron_s"]) == (1.0, 2.0)  # median seconds of each side
    assert gpt2["first_iteration"] == first
    assert summary["llama/dp2"]["median"] == 0.5  # behind is < 1
    table = bench.table(rows)
    assert "| GPT-2 | tp2 | 1.00 / 1.50 / 3.00 |" in table and "8.100000 / 8.100000" in table


def test_the_reported_iteration_is_the_rank_that_holds_the_loss():
    assert bench.reported([None, {"loss": 1.0}]) == {"loss": 1.0}  # pp2: the last stage
    assert bench.reported({"loss": 2.0}) == {"loss": 2.0}  # one process


def test_every_layout_trains_the_same_global_batch():
    assert {layout.world_size for layout in bench.LAYOUTS.values()} == {1, 2}
    assert bench.MICRO_BATCHES % max(layout.data_parallel_size for layout in bench.LAYOUTS.values()) == 0
    assert len(bench.micro_batches()) == bench.MICRO_BATCHES


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --megatron-lm"),
    (["--megatron-lm", "{tmp}"], "holds no megatron/core/__init__.py: give the root of a Megatron-LM source tree"),
    (["--megatron-lm", "{tree}", "--rounds", "0"], "--rounds must be at least 1"),
    (["--megatron-lm", "{tree}", "--layouts", "tp4"], "invalid choice: 'tp4'"),
])
def test_bad_arguments_fail_with_one_error_line_before_any_process_starts(tmp_path, capsys, argv, message):
    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "megatron" / "core" / "__init__.py").write_text("")
    argv = [a.format(tmp=tmp_path, tree=tree) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


def _sum_of_ranks(value):
    """A contender's build on each rank: a process group from torchrun's variables, one call summing."""
    dist.init_process_group("gloo", init_method="env://")

    def call(scale):
        import torch

        total = torch.tensor([float(dist.get_rank() + value)])
        dist.all_reduce(total)
        return total.item() * scale
    return call, (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def test_a_contender_world_runs_each_call_on_every_rank():
    with Contender(_sum_of_ranks, 10, threads=1, world_size=2) as world:
        assert world.info == [(0, 2), (1, 2)]
        seconds, results = world(2)
    assert results == [42.0, 42.0]  # (10 + 0) + (10 + 1), on both ranks, times 2
    assert seconds.wall > 0 and seconds.cpu > 0


MEGATRON_LM = os.environ.get("MEGATRON_LM")  # a Megatron-LM source tree whose imports resolve here


@pytest.mark.skipif(not MEGATRON_LM or importlib.util.find_spec("einops") is None,
                    reason="needs MEGATRON_LM=<a Megatron-LM source tree> and its dependencies "
                           "(tools/make_megatron_fixtures.py's Snapshots builds both)")
def test_megatron_core_and_ours_start_from_the_same_loss_and_gradient_norm(tmp_path):
    out = tmp_path / "ratios.json"
    assert bench.main(["--megatron-lm", MEGATRON_LM, "--shapes", "llama", "--layouts", "pp2", "--rounds", "1",
                       "--json", str(out)]) == 0
    first = json.loads(out.read_text())["llama/pp2"]["first_iteration"]
    assert first["ours"]["loss"] == pytest.approx(first["megatron"]["loss"], rel=1e-6)
    assert first["ours"]["grad_norm"] == pytest.approx(first["megatron"]["grad_norm"], rel=1e-5)
