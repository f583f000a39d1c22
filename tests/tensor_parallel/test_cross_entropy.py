"""Vocab-parallel cross entropy against torch.nn.functional.cross_entropy, value and gradient: the three-reduction
form on 2 and 4 ranks, the fused log_softmax form that one rank takes, and the two forms against each other; the
vocab-parallel entropy (--grpo's logged statistic) against torch's, with -inf padding on the last rank."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.process_groups.collectives import count_collectives
from megatron_lite.process_groups.parallel_state import initialize_model_parallel
from megatron_lite.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lite.tensor_parallel.cross_entropy import (_CrossEntropy, _VocabParallelCrossEntropy,
                                                       vocab_parallel_entropy)

S, B, V = 6, 3, 32


def _reference():
    generator = torch.Generator().manual_seed(0)
    # Large logits: the max subtraction must keep exp() finite.
    logits = 30 * torch.randn(S, B, V, generator=generator)
    target = torch.randint(0, V, (S, B), generator=generator)
    upstream = torch.rand(S, B, generator=generator)
    full = logits.clone().requires_grad_()
    loss = F.cross_entropy(full.view(-1, V), target.view(-1), reduction="none").view(S, B)
    (loss * upstream).sum().backward()
    return logits, target, upstream, loss.detach(), full.grad


def _check(rank, world_size):
    group = initialize_model_parallel(world_size).tensor_model_parallel_group
    logits, target, upstream, expected_loss, expected_grad = _reference()
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    with count_collectives() as forward_count:
        loss = vocab_parallel_cross_entropy(local, target, group)
    with count_collectives() as backward_count:
        (loss * upstream).sum().backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local.grad, expected_grad.chunk(world_size, dim=-1)[rank], rtol=1e-5, atol=1e-6)
    assert loss.shape == (S, B)
    padded = logits / 10  # spread: entropies well above 0
    padded[..., -3:] = float("-inf")  # the vocabulary's padding rows, on the last rank
    entropy = vocab_parallel_entropy(padded.chunk(world_size, dim=-1)[rank], group)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=padded).entropy(), rtol=1e-5,
                               atol=1e-5)
    return dict(forward_count.calls), dict(backward_count.calls)


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_cross_entropy_on_sharded_vocabulary(run_distributed, world_size):
    forward, backward = run_distributed(_check, world_size)[0]
    # max, target logit, sum of exponentials: three [s, b] all-reduces; the backward is local.
    assert forward == {("all_reduce", "tensor"): 3}
    assert backward == {}


def test_single_rank_matches_cross_entropy():
    _check(0, 1)


def test_low_precision_logits_are_reduced_in_float32():
    logits, target, _, expected_loss, _ = _reference()
    local = logits.bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, None)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, F.cross_entropy(logits.bfloat16().float().view(-1, V), target.view(-1),
                                                     reduction="none").view(S, B))


def test_shape_mismatch_is_explained():
    with pytest.raises(ValueError, match="must agree"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, V), torch.zeros(3, 2, dtype=torch.long), None)


def test_one_rank_form_matches_the_vocab_parallel_form():
    """The fused form a single rank takes against the three-reduction form run on one rank: losses and gradients
    agree, including vocabulary padding masked to -inf (it gets no probability and no gradient)."""
    logits, target, upstream, _, _ = _reference()
    logits[..., -3:] = float("-inf")
    target = target % (V - 3)  # padding is never a target
    results = []
    for form in (lambda x: _CrossEntropy.apply(x, target), lambda x: _VocabParallelCrossEntropy.apply(x, target, None)):
        x = logits.clone().requires_grad_()
        loss = form(x)
        (loss * upstream).sum().backward()
        results.append((loss.detach(), x.grad))
    (fused_loss, fused_grad), (parallel_loss, parallel_grad) = results
    torch.testing.assert_close(fused_loss, parallel_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fused_grad, parallel_grad, rtol=1e-6, atol=1e-7)
    assert fused_loss.isfinite().all() and (fused_grad[..., -3:] == 0).all()


def test_one_rank_form_refuses_a_second_backward():
    """Its backward overwrites the saved log-probabilities: a retained graph cannot run it twice silently."""
    logits, target, _, _, _ = _reference()
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, None).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
