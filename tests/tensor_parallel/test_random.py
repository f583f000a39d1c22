"""The RNG tracker's named states and checkpointing that replays them."""
import torch
import torch.nn.functional as F

from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import checkpoint, get_rng_tracker, model_parallel_seed

SEED = 1234


def test_model_parallel_seed_seeds_default_and_tensor_parallel_states():
    model_parallel_seed(SEED, tp_rank=3)
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(SEED)))
    with get_rng_tracker().fork():
        inside = torch.rand(5)
    assert torch.equal(inside, torch.rand(5, generator=torch.Generator().manual_seed(SEED + 2718 + 3)))


def test_fork_leaves_default_stream_untouched_and_advances_named_state():
    model_parallel_seed(SEED, tp_rank=0)
    first = torch.rand(4)
    with get_rng_tracker().fork():
        forked_a = torch.rand(4)
    second = torch.rand(4)
    with get_rng_tracker().fork():
        forked_b = torch.rand(4)
    reference = torch.Generator().manual_seed(SEED)
    assert torch.equal(torch.cat([first, second]), torch.rand(8, generator=reference))
    assert not torch.equal(forked_a, forked_b)


def _dropout_masks(rank, world_size):
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_seed(SEED, state.tensor_model_parallel_rank)
    ones = torch.ones(64)
    outside = F.dropout(ones, p=0.5)
    with get_rng_tracker().fork():
        inside = F.dropout(ones, p=0.5)
    return state.tensor_model_parallel_rank, outside, inside


def test_dropout_differs_across_tensor_parallel_ranks_only_inside_the_region(run_distributed):
    # 4 ranks: tp=2 x dp=2. Ranks 0 and 2 share tp rank 0, ranks 1 and 3 tp rank 1.
    results = run_distributed(_dropout_masks, 4)
    assert [tp_rank for tp_rank, _, _ in results] == [0, 1, 0, 1]
    outside = [r[1] for r in results]
    inside = [r[2] for r in results]
    assert all(torch.equal(outside[0], o) for o in outside)
    assert not torch.equal(inside[0], inside[1])
    assert torch.equal(inside[0], inside[2]) and torch.equal(inside[1], inside[3])


def _block(x, weight):
    """Dropout from both states, so both must be replayed by the recomputation."""
    h = F.dropout(x @ weight, p=0.5)
    with get_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p=0.5)
    return h, h.sum()


def _run(use_checkpoint):
    model_parallel_seed(SEED, tp_rank=1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, generator=generator).requires_grad_()
    weight = torch.randn(8, 8, generator=generator).requires_grad_()
    out, total = checkpoint(_block, x, weight) if use_checkpoint else _block(x, weight)
    (out * 2).sum().add(total).backward()
    # The states after backward: recomputation must not have consumed extra random numbers.
    after = torch.rand(3)
    with get_rng_tracker().fork():
        after_forked = torch.rand(3)
    return out.detach(), x.grad, weight.grad, after, after_forked


def test_checkpoint_replays_both_rng_states_and_restores_them():
    plain, checkpointed = _run(False), _run(True)
    for expected, actual in zip(plain, checkpointed):
        assert torch.equal(expected, actual)


def test_checkpoint_gives_parameter_grads_when_no_input_needs_grad():
    weight = torch.randn(4, 4, requires_grad=True)
    # Frozen inputs (LoRA over frozen embeddings): the parameters inside still get gradients.
    out = checkpoint(lambda x, scale: (x @ weight) * scale, torch.randn(2, 4), 3.0)
    out.sum().backward()
    assert weight.grad is not None and out.requires_grad
