from types import SimpleNamespace

import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.optimizer.optimizer_param_scheduler import OptimizerParamScheduler


def _optimizer(*groups):
    """Any object with ``param_groups`` works; a namespace keeps the test free of torch.optim."""
    return SimpleNamespace(param_groups=[dict(g) for g in (groups or ({},))])


def _scheduler(style, optimizer=None, **overrides):
    kwargs = dict(max_lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_decay_steps=110, lr_decay_style=style)
    kwargs.update(overrides)
    return OptimizerParamScheduler(optimizer or _optimizer(), **kwargs)


def _lrs_at(scheduler, steps):
    """lr at each of the (increasing) ``steps``, reached by step(increment)."""
    lrs = []
    for target in steps:
        scheduler.step(increment=target - scheduler.num_steps)
        lrs.append(scheduler.get_lr())
        assert scheduler.optimizer.param_groups[0]["lr"] == lrs[-1]
    return lrs


# Hand computation with max 1.0, min 0.1, warmup 10, decay ends at 110 (100 decay steps):
#   step 0: 0; step 5: 5/10 = 0.5; step 10: 1.0
#   step 35: ratio 0.25 -> linear 0.1 + 0.9 * 0.75 = 0.775
#                          cosine 0.1 + 0.9 * 0.5 * (cos(pi/4) + 1) = 0.1 + 0.9 * 0.853553390593 = 0.868198051534
#   step 60: ratio 0.5 -> both 0.1 + 0.9 * 0.5 = 0.55
#   step 85: ratio 0.75 -> linear 0.1 + 0.9 * 0.25 = 0.325; cosine 0.1 + 0.9 * 0.146446609407 = 0.231801948466
#   step 110: min 0.1; step 500: 0.1
STEPS = [0, 5, 10, 35, 60, 85, 110, 111, 500]
EXPECTED = {
    "linear": [0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1],
    "cosine": [0.0, 0.5, 1.0, 0.868198051534, 0.55, 0.231801948466, 0.1, 0.1, 0.1],
    "constant": [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
}


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_lr_at_key_steps(style):
    assert _lrs_at(_scheduler(style), STEPS) == pytest.approx(EXPECTED[style], abs=1e-12)


def test_lr_is_set_on_construction_and_step_defaults_to_one():
    optimizer = _optimizer({"lr": 123.0})
    scheduler = _scheduler("cosine", optimizer, lr_warmup_steps=4)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the first iteration runs at step 0
    scheduler.step()
    assert scheduler.num_steps == 1 and optimizer.param_groups[0]["lr"] == 0.25


def test_no_warmup_starts_at_max_lr():
    scheduler = _scheduler("linear", lr_warmup_steps=0, lr_decay_steps=100)
    assert _lrs_at(scheduler, [0, 50, 100, 101]) == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_lr_mult_scales_each_group():
    optimizer = _optimizer({}, {"lr_mult": 0.5}, {"lr_mult": 0.0})
    scheduler = _scheduler("cosine", optimizer)
    scheduler.step(60)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.55, 0.275, 0.0])


def test_drives_a_torch_optimizer():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [param], "weight_decay": 0.0}], lr=99.0)
    scheduler = _scheduler("linear", optimizer)
    scheduler.step(35)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.775)
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # left alone without start_wd/end_wd


@pytest.mark.parametrize("style, expected", [
    # start 0.0, end 0.1 over 100 steps; cosine coeff at ratio r is 0.5 * (cos(pi * (1 - r)) + 1).
    ("linear", [0.0, 0.025, 0.05, 0.1, 0.1]),
    ("cosine", [0.0, 0.1 * 0.146446609407, 0.05, 0.1, 0.1]),
])
def test_weight_decay_increment(style, expected):
    optimizer = _optimizer({}, {"wd_mult": 0.0})
    scheduler = _scheduler("constant", optimizer, start_wd=0.0, end_wd=0.1, wd_incr_steps=100,
                           wd_incr_style=style)
    got = []
    for target in [0, 25, 50, 100, 150]:
        scheduler.step(target - scheduler.num_steps)
        got.append(optimizer.param_groups[0]["weight_decay"])
        assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert got == pytest.approx(expected, abs=1e-12)


def test_constant_weight_decay():
    optimizer = _optimizer({"weight_decay": 0.5})
    scheduler = _scheduler("cosine", optimizer, start_wd=0.01, end_wd=0.01)
    scheduler.step(70)
    assert optimizer.param_groups[0]["weight_decay"] == 0.01 and scheduler.get_wd() == 0.01


def test_state_dict_round_trip():
    reference = _scheduler("cosine")
    reference.step(37)
    resumed_optimizer = _optimizer()
    resumed = _scheduler("cosine", resumed_optimizer)
    resumed.load_state_dict(reference.state_dict())
    assert resumed.num_steps == 37
    assert resumed_optimizer.param_groups[0]["lr"] == reference.get_lr()  # applied without a step
    for _ in range(80):
        reference.step()
        resumed.step()
        assert resumed.get_lr() == reference.get_lr()


def test_loading_a_different_schedule_names_the_flag():
    state = _scheduler("cosine").state_dict()
    with pytest.raises(ConfigError, match="--lr-decay-iters"):
        _scheduler("cosine", lr_decay_steps=200).load_state_dict(state)
    with pytest.raises(ConfigError, match="--lr\\b"):
        _scheduler("cosine", max_lr=2.0).load_state_dict(state)


def test_override_keeps_this_runs_schedule_and_use_checkpoint_takes_the_checkpoints():
    saved = _scheduler("cosine")
    saved.step(40)
    longer = _scheduler("cosine", lr_decay_steps=200)
    longer.load_state_dict(saved.state_dict(), override=True)
    assert longer.num_steps == 40 and longer.lr_decay_steps == 200
    fresh_longer = _scheduler("cosine", lr_decay_steps=200)
    fresh_longer.step(40)
    assert longer.get_lr() == fresh_longer.get_lr()
    kept = _scheduler("cosine", lr_decay_steps=200)
    kept.load_state_dict(saved.state_dict(), use_checkpoint=True)
    assert kept.lr_decay_steps == saved.lr_decay_steps and kept.get_lr() == saved.get_lr()
    with pytest.raises(ConfigError, match="contradict"):
        kept.load_state_dict(saved.state_dict(), override=True, use_checkpoint=True)


@pytest.mark.parametrize("overrides, flag", [
    (dict(lr_decay_style="exponential"), "--lr-decay-style"),
    (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=10, lr_wsd_decay_style="square"), "--lr-wsd-decay-style"),
    (dict(init_lr=2.0), "--lr-warmup-init"),
    (dict(min_lr=2.0), "--min-lr"),
    (dict(min_lr=-0.1), "--min-lr"),
    (dict(lr_warmup_steps=110), "--lr-warmup-iters"),
    (dict(lr_warmup_steps=-1), "--lr-warmup-iters"),
    (dict(lr_decay_steps=0, lr_warmup_steps=0), "--lr-decay-iters"),
    (dict(start_wd=0.1), "--end-weight-decay"),
    (dict(start_wd=0.2, end_wd=0.1, wd_incr_style="linear", wd_incr_steps=10), "--start-weight-decay"),
    (dict(start_wd=0.0, end_wd=0.1), "constant needs"),
    (dict(start_wd=0.0, end_wd=0.1, wd_incr_style="linear"), "wd_incr_steps"),
    (dict(wd_incr_style="exponential"), "--weight-decay-incr-style"),
    (dict(lr_warmup_style="exp"), "--lr-warmup-style"),
    (dict(lr_warmup_style="log", samples_per_iteration=10), "--lr-warmup-style log needs a warmup of at least 2"),
])
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        _scheduler("cosine", **overrides)



# Hand computation, same end points (max 1.0, min 0.1, warmup 10, decay ends at 110):
#   WSD, the last 40 steps anneal (from step 70): step 35 and 70 stable at 1.0; step 90 ratio 0.5 ->
#     linear 0.1 + 0.9 * 0.5 = 0.55; exponential 2 * 0.5^0.5 - 1 = 0.414213562373 -> 0.472792206136;
#     minus_sqrt 1 - sqrt(0.5) = 0.292893218813 -> 0.363603896932; cosine 0.55
#   inverse-square-root: step 40 -> sqrt(10 / 40) = 0.5; step 90 -> sqrt(1 / 9), not below min: 0.333333333333
@pytest.mark.parametrize("wsd_style, at_90", [("linear", 0.55), ("exponential", 0.472792206136),
                                              ("minus_sqrt", 0.363603896932), ("cosine", 0.55)])
def test_wsd_is_stable_then_anneals(wsd_style, at_90):
    scheduler = _scheduler("WSD", wsd_decay_steps=40, lr_wsd_decay_style=wsd_style)
    assert _lrs_at(scheduler, [5, 35, 70, 90, 110, 111]) == pytest.approx([0.5, 1.0, 1.0, at_90, 0.1, 0.1], abs=1e-12)


def test_inverse_square_root_and_its_floor():
    lrs = _lrs_at(_scheduler("inverse-square-root"), [10, 40, 90, 110, 111])
    assert lrs == pytest.approx([1.0, 0.5, 1 / 3, max(0.1, (10 / 110) ** 0.5), 0.1], abs=1e-12)
    assert _lrs_at(_scheduler("inverse-square-root", min_lr=0.6), [40]) == [0.6]


def test_warmup_starts_at_init_lr():
    assert _lrs_at(_scheduler("linear", init_lr=0.2), [0, 5, 10]) == pytest.approx([0.2, 0.6, 1.0], abs=1e-12)


# Hand computation of DeepSpeed's log warmup, 4 samples per iteration, warmup 40 samples = W 10 iterations, so
# ln(max(i, 1)) / ln(10) = log10(i): iterations 0 and 1 -> 0, 2 -> 0.301029995664, 4 -> 0.602059991328, 10 -> 1;
# with init 0.2: 0.2 + 0.8 x that. After warmup the decay is unchanged (ends at 140; step 90: 0.55).
def test_log_warmup_counts_iterations_as_deepspeed_does():
    scheduler = _scheduler("cosine", init_lr=0.2, lr_warmup_style="log", samples_per_iteration=4, lr_warmup_steps=40,
                           lr_decay_steps=140)
    lrs = _lrs_at(scheduler, [0, 4, 8, 16, 40, 90])
    assert lrs == pytest.approx([0.2, 0.2, 0.2 + 0.8 * 0.301029995664, 0.2 + 0.8 * 0.602059991328, 1.0, 0.55],
                                abs=1e-12)


def test_checkpoint_from_before_init_lr_wsd_and_warmup_style_loads():
    """A checkpoint saved before --lr-warmup-init, WSD and --lr-warmup-style existed had linear warmup from 0 and
    no WSD."""
    saved = _scheduler("cosine")
    saved.step(increment=30)
    new_keys = ("init_lr", "wsd_decay_steps", "lr_wsd_decay_style", "lr_warmup_style", "samples_per_iteration")
    old = {k: v for k, v in saved.state_dict().items() if k not in new_keys}
    resumed = _scheduler("cosine")
    resumed.load_state_dict(old)
    assert resumed.num_steps == 30 and resumed.get_lr() == saved.get_lr()
    with pytest.raises(ConfigError, match="--lr-warmup-init"):
        _scheduler("cosine", init_lr=0.1).load_state_dict(old)
    with pytest.raises(ConfigError, match="--lr-warmup-style \\(checkpoint 'linear', this run 'log'\\)"):
        _scheduler("cosine", lr_warmup_style="log", samples_per_iteration=1).load_state_dict(old)
