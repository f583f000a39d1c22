import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


def _scaler(**overrides):
    kwargs = dict(initial_scale=2.0 ** 16, min_scale=1.0, growth_interval=3, hysteresis=2)
    kwargs.update(overrides)
    return DynamicGradScaler(**kwargs)


def _run(scaler, found_infs):
    """The scale after each update."""
    scales = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        scales.append(scaler.scale.item())
    return scales


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(1024.0)
    assert scaler.scale.dtype == torch.float32 and scaler.scale.item() == 1024.0
    assert scaler.inv_scale.item() == 1.0 / 1024.0
    for found_inf in (True, True, False, True):
        scaler.update(found_inf)
    assert scaler.scale.item() == 1024.0
    other = ConstantGradScaler(1024.0)
    other.load_state_dict(scaler.state_dict())
    assert other.scale.item() == 1024.0


def test_scale_is_float32_and_inverse_is_reciprocal():
    scaler = _scaler(initial_scale=2.0 ** 32)
    assert scaler.scale.dtype == torch.float32 and scaler.scale.item() == 2.0 ** 32
    assert scaler.inv_scale.dtype == torch.float32 and scaler.inv_scale.item() == 2.0 ** -32
    assert ConstantGradScaler(3.0).inv_scale.item() == torch.tensor(1.0 / 3.0, dtype=torch.float32).item()


def test_hysteresis_absorbs_first_overflow_then_every_overflow_backs_off():
    s = 2.0 ** 16
    # The budget of 2 is spent by the second overflow; it is refilled only by growth,
    # so the third overflow backs off again even though a clean step came between.
    assert _run(_scaler(), [True, True, False, True]) == [s, s / 2, s / 2, s / 4]


def test_growth_after_window_of_clean_steps_refills_hysteresis():
    s = 2.0 ** 16
    # Two overflows halve the scale; three clean steps double it and restore the budget,
    # so the next single overflow is absorbed again.
    got = _run(_scaler(), [True, True, False, False, False, True, True])
    assert got == [s, s / 2, s / 2, s / 2, s, s, s / 2]


def test_overflow_restarts_growth_window():
    s = 2.0 ** 16
    got = _run(_scaler(hysteresis=5), [False, False, True, False, False, False, False, False, False])
    assert got == [s, s, s, s, s, 2 * s, 2 * s, 2 * s, 4 * s]


def test_backoff_stops_at_min_scale():
    got = _run(_scaler(initial_scale=8.0, min_scale=3.0, hysteresis=1), [True, True, True])
    assert got == [4.0, 3.0, 3.0]


def test_custom_factors():
    got = _run(_scaler(initial_scale=100.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1,
                       hysteresis=1), [True, False, False])
    assert got == [25.0, 100.0, 400.0]


def test_state_dict_round_trip_resumes_the_same_sequence():
    steps = [True, False, False, True, True, False, False, False, True, False, True, True]
    reference = _scaler()
    expected = _run(reference, steps)

    first = _scaler()
    got = _run(first, steps[:5])
    state = first.state_dict()
    resumed = _scaler(initial_scale=1.0)  # constructor values must be overwritten by the checkpoint
    resumed.load_state_dict(state)
    got += _run(resumed, steps[5:])
    assert got == expected
    assert resumed.scale.dtype == torch.float32
    # The saved state is a copy, not the live tensor.
    first.update(True)
    first.update(True)
    assert state["scale"].item() == expected[4]


def test_update_accepts_a_bool_tensor():
    scaler = _scaler(hysteresis=1)
    scaler.update(torch.tensor(True))
    scaler.update(torch.tensor(False))
    assert scaler.scale.item() == 2.0 ** 15


@pytest.mark.parametrize("kwargs, flag", [
    (dict(initial_scale=0.0), "--initial-loss-scale"),
    (dict(min_scale=0.0), "--min-loss-scale"),
    (dict(initial_scale=1.0, min_scale=2.0), "--min-loss-scale"),
    (dict(growth_interval=0), "--loss-scale-window"),
    (dict(hysteresis=0), "--hysteresis"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(growth_factor=1.0), "growth_factor"),
])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        _scaler(**kwargs)
    with pytest.raises(ConfigError, match="--loss-scale"):
        ConstantGradScaler(-1.0)
