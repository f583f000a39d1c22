"""The planner's pipeline terms against the full schedule tables the training run executes."""
import pytest

from megatron_lite.pipeline_parallel.schedule_table import OpKind, build_schedule, rank_schedule
from megatron_lite.pipeline_parallel.timeline import simulate
from megatron_lite.planner.pipeline import bubble_fraction, peak_activation_bytes

GRID = [(p, m, v) for p in (2, 3, 4, 8) for v in (1, 2, 3) for m in range(p, 5 * p + 1) if v == 1 or m % p == 0]


@pytest.mark.parametrize("p,m,v", GRID)
def test_bubble_is_the_full_tables_and_the_textbook_formula(p, m, v):
    """(p-1)/m for 1F1B and (p-1)/(v m) interleaved (docs/reference.md section 5), from shortened tables."""
    full = simulate(build_schedule(p, m, v)).bubble_fraction
    assert bubble_fraction(p, m, v) == pytest.approx(full, abs=1e-9)
    assert bubble_fraction(p, m, v) == pytest.approx((p - 1) / (v * m), abs=1e-9)


def test_bubble_is_the_same_when_backward_costs_more():
    """Recomputation makes a backward cost three forwards: the tables' bubble does not move."""
    for p, m, v in [(4, 8, 1), (4, 8, 2), (8, 24, 3)]:
        assert simulate(build_schedule(p, m, v), 1.0, 3.0).bubble_fraction == pytest.approx(bubble_fraction(p, m, v))


def test_no_pipeline_no_bubble():
    assert bubble_fraction(1, 7) == 0.0


@pytest.mark.parametrize("p,m,v", GRID[::3])
def test_peak_activations_walk_the_full_table(p, m, v):
    kept = tuple(10.0 + 3 * c for c in range(v))
    extra = tuple(4.0 + c for c in range(v))
    for rank in range(p):
        alive = peak = 0.0
        for op in rank_schedule(p, rank, m, v):
            if op.kind == OpKind.FORWARD:
                alive += kept[op.chunk]
                peak = max(peak, alive)
            elif op.kind == OpKind.BACKWARD:
                peak = max(peak, alive + extra[op.chunk])
                alive -= kept[op.chunk]
        assert peak_activation_bytes(p, rank, m, kept, extra) == pytest.approx(peak)


def test_1f1b_holds_p_minus_rank_microbatches():
    """docs/reference.md section 5: at most p - r micro-batches alive on stage r."""
    for rank in range(4):
        assert peak_activation_bytes(4, rank, 16, (1.0,)) == 4 - rank
