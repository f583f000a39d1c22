import numpy as np
import pytest
import torch

from megatron_lite.data import MegatronPretrainingSampler, MockGPTDataset, build_pretraining_data_loader


class CountingDataset:
    """Sample i is [i, i+1, ..., i+seq_length]: the batch says which samples it holds."""

    def __init__(self, size, seq_length=4):
        self.size, self.seq_length = size, seq_length

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"tokens": np.arange(i, i + self.seq_length + 1, dtype=np.int64)}


def rank_batches(total, consumed, micro, rank, size):
    return list(MegatronPretrainingSampler(total_samples=total, consumed_samples=consumed, micro_batch_size=micro,
                                           data_parallel_rank=rank, data_parallel_size=size))


def test_every_data_parallel_size_sees_the_same_global_batches():
    global_order = list(range(3, 99))  # resuming after 3 consumed samples; 99 total
    for size in (1, 2, 4):
        per_rank = [rank_batches(99, 3, 2, rank, size) for rank in range(size)]
        steps = len(per_rank[0])
        assert steps == (99 - 3) // (2 * size) and all(len(b) == steps for b in per_rank)
        seen = [i for step in range(steps) for rank in range(size) for i in per_rank[rank][step]]
        assert seen == global_order[:steps * 2 * size]  # partial last step dropped


def test_resume_continues_exactly_even_with_another_data_parallel_size():
    uninterrupted = [i for batch in rank_batches(64, 0, 4, 0, 1) for i in batch]
    first_run = [i for step in zip(*(rank_batches(64, 0, 2, r, 2) for r in range(2))) for b in step for i in b][:24]
    resumed = [i for step in zip(*(rank_batches(64, 24, 1, r, 4) for r in range(4))) for b in step for i in b]
    assert first_run + resumed == uninterrupted


def test_loader_shapes_shift_and_stop():
    loader = build_pretraining_data_loader(CountingDataset(10), consumed_samples=4, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2)
    batch = next(loader)
    assert torch.equal(batch["tokens"], torch.tensor([[6, 7, 8, 9], [7, 8, 9, 10]]))
    assert torch.equal(batch["labels"], batch["tokens"] + 1)
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    assert torch.equal(batch["position_ids"], torch.arange(4).expand(2, 4))
    with pytest.raises(StopIteration):  # samples 8-9 are not a full step of 4
        next(loader)
    assert build_pretraining_data_loader(None, consumed_samples=0, micro_batch_size=1, data_parallel_rank=0,
                                         data_parallel_size=1) is None


def test_worker_processes_give_the_same_batches():
    def batches(num_workers):
        return [b["tokens"] for b in build_pretraining_data_loader(
            CountingDataset(20), consumed_samples=2, micro_batch_size=3, data_parallel_rank=0,
            data_parallel_size=2, num_workers=num_workers)]
    assert all(torch.equal(a, b) for a, b in zip(batches(0), batches(2), strict=True))


def test_eod_mask_loss_masks_positions_whose_input_is_eod():
    batch = next(build_pretraining_data_loader(CountingDataset(4), consumed_samples=0, micro_batch_size=2,
                                               data_parallel_rank=0, data_parallel_size=1, eod_token=2,
                                               eod_mask_loss=True))
    # tokens [[0,1,2,3],[1,2,3,4]]: the position holding EOD (2) would predict the next document.
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 1, 1]]
    with pytest.raises(ValueError, match="EOD"):
        build_pretraining_data_loader(CountingDataset(4), consumed_samples=0, micro_batch_size=1,
                                      data_parallel_rank=0, data_parallel_size=1, eod_mask_loss=True)


def test_bad_positions_are_rejected():
    with pytest.raises(ValueError, match="beyond the dataset"):
        rank_batches(10, 11, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        rank_batches(10, 0, 1, 2, 2)


def test_mock_batches_are_identical_across_data_parallel_layouts():
    dataset = MockGPTDataset(vocab_size=1000, seq_length=16, seed=7, num_samples=64)
    single = build_pretraining_data_loader(dataset, consumed_samples=8, micro_batch_size=4, data_parallel_rank=0,
                                           data_parallel_size=1)
    pairs = [build_pretraining_data_loader(MockGPTDataset(vocab_size=1000, seq_length=16, seed=7, num_samples=64),
                                           consumed_samples=8, micro_batch_size=2, data_parallel_rank=r,
                                           data_parallel_size=2) for r in range(2)]
    for _ in range(3):
        assert torch.equal(next(single)["tokens"], torch.cat([next(pairs[0])["tokens"], next(pairs[1])["tokens"]]))
