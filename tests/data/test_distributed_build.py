"""The lead's calling pattern on real ranks: global rank 0 builds, barrier, the others load."""
import numpy as np
import torch
import torch.distributed as dist

from megatron_lite.data import build_pretraining_data_loader, build_train_valid_test_datasets
from tests.data.test_gpt_dataset import write_corpus


def _build_then_read(rank, world_size, data_path, cache_path):
    kwargs = dict(data_path=data_path, split="90,10,0", seq_length=8, seed=11,
                  train_valid_test_num_samples=(64, 8, 0), data_cache_path=cache_path)
    if rank == 0:
        datasets = build_train_valid_test_datasets(**kwargs, is_builder_rank=True)
    dist.barrier()
    if rank != 0:
        datasets = build_train_valid_test_datasets(**kwargs, is_builder_rank=False, cache_wait_timeout_s=10)
    loader = build_pretraining_data_loader(datasets[0], consumed_samples=16, micro_batch_size=2,
                                           data_parallel_rank=rank, data_parallel_size=world_size)
    return [batch["tokens"] for batch in loader]


def test_rank_zero_builds_and_the_others_load(tmp_path, run_distributed):
    rng = np.random.default_rng(0)
    a = write_corpus(tmp_path / "a", rng.integers(3, 30, size=50))
    b = write_corpus(tmp_path / "b", rng.integers(3, 30, size=80), first_token=10_000)
    data_path = ["0.4", a, "0.6", b]
    per_rank = run_distributed(_build_then_read, world_size=2, args=(data_path, str(tmp_path / "cache")))
    train, _, _ = build_train_valid_test_datasets(data_path=data_path, split="90,10,0", seq_length=8, seed=11,
                                                  train_valid_test_num_samples=(64, 8, 0),
                                                  data_cache_path=str(tmp_path / "cache"))
    assert len(per_rank[0]) == len(per_rank[1]) == (64 - 16) // 4
    for step, (rank0, rank1) in enumerate(zip(*per_rank)):
        expected = [train[16 + 4 * step + i]["tokens"][:-1] for i in range(4)]
        assert torch.equal(torch.cat([rank0, rank1]), torch.from_numpy(np.stack(expected)))
