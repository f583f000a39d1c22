"""Muon's momentum saves and reshards like Adam's moments: a run saved at iteration 2 of 4 under tp2 x dp2 with
the distributed optimizer resumes at one process and under ZeRO-3 at dp2, and continues as if uninterrupted."""
import pytest

from megatron_lite.checkpointing import storage
from tests.checkpointing.common import LLAMA, assert_continues, losses_of, train
from tests.distributed import run_distributed

MUON = {"optimizer": "muon", "muon_fp32_matmul_prec": "high", "muon_nesterov": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("muon"))
    losses = losses_of(run_distributed(train, 4, args=(dict(tp=2, arch=LLAMA, dist_opt=True, save=root,
                                                            save_interval=2, optimizer=MUON),)))
    storage.write_latest_iteration(root, 2)
    return root, losses


@pytest.mark.parametrize("world_size, layout", [(1, {}), (2, {"strategy": "optim_grads_params"})])
def test_muon_state_resumes_under_other_layouts(saved, world_size, layout):
    root, reference = saved
    resumed = losses_of(run_distributed(train, world_size, args=(dict(load=root, arch=LLAMA, optimizer=MUON,
                                                                      **layout),)))
    assert_continues(resumed, reference)


def test_muon_momentum_matters_on_resume(saved):
    """Resuming without the optimizer state (fresh momentum) visibly changes iteration 4."""
    root, reference = saved
    resumed = losses_of(run_distributed(train, 1, args=(dict(load=root, arch=LLAMA, optimizer=MUON,
                                                             no_load_optim=True),)))
    assert abs(resumed[3] - reference[3]) > 1e-4 * reference[3]
