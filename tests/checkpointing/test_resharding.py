"""A checkpoint saved at (tp, pp, dp) = (2, 2, 2) resumes under other layouts, optimizer state included.

Each source run trains 4 iterations uninterrupted and saves at iteration 2; the
resumed runs train iterations 3 and 4. Iteration 3's loss checks the weights,
iteration 4's the optimizer state (Adam moments and step) and the LR schedule.
"""
import json
import os

import pytest

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.offline import reshard_checkpoint
from tests.checkpointing.common import GPT2, LLAMA, assert_continues, losses_of, train
from tests.distributed import run_distributed

RTOL = 1e-5


def _source(tmp_path_factory, name, **kwargs):
    root = str(tmp_path_factory.mktemp(name))
    losses = losses_of(run_distributed(train, 8, args=(dict(tp=2, pp=2, save=root, save_interval=2, **kwargs),)))
    storage.write_latest_iteration(root, 2)  # resume from iteration 2 (iteration 4 was saved too)
    return root, losses


@pytest.fixture(scope="module")
def llama_distopt(tmp_path_factory):
    """Llama-style (SwiGLU stride-2 shards, GQA, untied output) with the distributed optimizer."""
    return _source(tmp_path_factory, "llama", arch=LLAMA, dist_opt=True)


@pytest.fixture(scope="module")
def gpt2_plain(tmp_path_factory):
    """GPT-2-style (biases, learned positions, embedding tied across pipeline stages), plain optimizer."""
    return _source(tmp_path_factory, "gpt2", arch=GPT2, dist_opt=False)


def _resume(root, world_size, **kwargs):
    return losses_of(run_distributed(train, world_size, args=(dict(load=root, **kwargs),)))


def test_metadata_describes_every_split(llama_distopt):
    root, _ = llama_distopt
    with open(os.path.join(storage.checkpoint_dir(root, 2), storage.METADATA_FILE)) as f:
        metadata = json.load(f)
    assert metadata["layout"]["tensor_model_parallel_size"] == 2 and metadata["layout"]["data_parallel_size"] == 2
    fc1 = metadata["tensors"]["decoder.layers.3.mlp.linear_fc1.weight"]
    assert fc1["global_shape"] == [128, 32] and fc1["partition_dim"] == 0 and fc1["partition_stride"] == 2
    assert sorted(s["tp_rank"] for s in fc1["shards"]) == [0, 1]
    proj = metadata["tensors"]["decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj["partition_dim"] == 1
    # Distributed-optimizer state: two data-parallel slices per tensor-parallel shard, tiling it.
    exp_avg = metadata["tensors"]["optimizer.exp_avg.decoder.layers.3.mlp.linear_fc1.weight"]
    ranges = sorted(tuple(s["flat_range"]) for s in exp_avg["shards"] if s["tp_rank"] == 0)
    assert ranges[0][0] == 0 and ranges[-1][1] == 64 * 32
    assert metadata["tensors"]["embedding.word_embeddings.weight"]["vocab_size"] == 60
    # The pipeline layer range of each file.
    stages = {info["pipeline_model_parallel_rank"]: info["layers"] for info in metadata["files"].values()}
    assert stages == {0: [0, 1], 1: [2, 3]}


@pytest.mark.parametrize("world_size,layout", [
    (1, dict(tp=1, pp=1)),
    (8, dict(tp=4, pp=1, dist_opt=True)),
    (8, dict(tp=1, pp=2, vpp=2)),
], ids=["tp1pp1dp1", "tp4pp1dp2-distopt", "tp1pp2dp4-vpp2"])
def test_distributed_optimizer_checkpoint_reshards(llama_distopt, world_size, layout):
    root, reference = llama_distopt
    assert_continues(_resume(root, world_size, arch=LLAMA, **layout), reference)


@pytest.mark.parametrize("world_size,layout", [
    (8, dict(tp=1, pp=2, dist_opt=True)),
    (8, dict(tp=4, pp=1)),
], ids=["tp1pp2dp4-distopt", "tp4pp1dp2"])
def test_plain_optimizer_checkpoint_reshards(gpt2_plain, world_size, layout):
    root, reference = gpt2_plain
    assert_continues(_resume(root, world_size, arch=GPT2, **layout), reference)


def test_offline_conversion_then_load(llama_distopt, tmp_path):
    root, reference = llama_distopt
    reshard_checkpoint(root, str(tmp_path), tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    with open(os.path.join(storage.checkpoint_dir(str(tmp_path), 2), storage.METADATA_FILE)) as f:
        files = json.load(f)["files"]
    assert len(files) == 8  # one file per (tp, pp) rank of the target layout
    assert_continues(_resume(str(tmp_path), 2, arch=LLAMA, tp=2, pp=1), reference)


def test_optimizer_state_matters(llama_distopt):
    """Control: without the optimizer state iteration 4 differs, so the tests above do check it."""
    root, reference = llama_distopt
    resumed = _resume(root, 1, arch=LLAMA, no_load_optim=True)
    assert resumed[2] == pytest.approx(reference[2], rel=RTOL)  # same weights
    assert abs(resumed[3] - reference[3]) > 1e-3
