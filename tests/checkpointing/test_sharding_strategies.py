"""Checkpoints reshard across data-parallel sharding strategies (ZeRO stages) as across layouts.

A ZeRO-3 run at dp 4 saves at iteration 2 of 4; it resumes under ZeRO-3 on the same layout
(bit for bit) and at tp2 x dp2 under ZeRO-1; a ZeRO-1 run at tp2 x dp2 resumes at dp 4 under
ZeRO-3 and at pp2 x dp2 under ZeRO-2. Iteration 3's loss checks the weights, iteration 4's the
optimizer state. GPT-2 style: biases, learned positions and a tied embedding.
"""
import pytest

from megatron_lite.checkpointing import storage
from tests.checkpointing.common import GPT2, assert_continues, losses_of, train
from tests.distributed import run_distributed

ZERO3_DP4 = dict(tp=1, pp=1, strategy="optim_grads_params")
ZERO1_TP2_DP2 = dict(tp=2, pp=1, strategy="optim", sequence_parallel=True)


def _run(world_size: int, **kwargs) -> list:
    return losses_of(run_distributed(train, world_size, args=(dict(arch=GPT2, **kwargs),)))


def _source(tmp_path_factory, name: str, layout: dict):
    root = str(tmp_path_factory.mktemp(name))
    losses = _run(4, save=root, save_interval=2, **layout)
    storage.write_latest_iteration(root, 2)  # resume from iteration 2 (iteration 4 was saved too)
    return root, losses


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return _source(tmp_path_factory, "zero3", ZERO3_DP4)


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return _source(tmp_path_factory, "zero1", ZERO1_TP2_DP2)


def test_zero3_resumes_bitwise_under_zero3(zero3):
    root, reference = zero3
    assert _run(4, load=root, **ZERO3_DP4) == reference


def test_zero3_resumes_at_tp2_dp2_under_zero1(zero3):
    root, reference = zero3
    assert_continues(_run(4, load=root, **ZERO1_TP2_DP2), reference)


@pytest.mark.parametrize("layout", [ZERO3_DP4, dict(tp=1, pp=2, strategy="optim_grads")], ids=["zero3-dp4",
                                                                                               "zero2-pp2dp2"])
def test_zero1_resumes_under_zero2_and_zero3(zero1, layout):
    root, reference = zero1
    assert_continues(_run(4, load=root, **layout), reference)
