import math

import pytest
import torch

from megatron_lite.process_groups.collectives import count_collectives
from megatron_lite.optimizer.clip_grads import (clip_grad_by_total_norm_fp32, count_zeros_fp32,
                                                get_grad_norm_fp32, get_grads_for_norm)


def _model_with_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    model(torch.randn(4, 6)).square().sum().backward()
    return model


def _single_process_norm(params, norm_type=2.0):
    grads = get_grads_for_norm(params, tensor_model_parallel_rank=0, is_pipeline_first_stage=True)
    return get_grad_norm_fp32(grads, model_parallel_group=None, norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_norm_matches_torch(norm_type):
    params = list(_model_with_grads().parameters())
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9, norm_type=norm_type).item()
    assert _single_process_norm(params, norm_type) == pytest.approx(expected, rel=1e-6)


def test_clipping_matches_torch():
    ours, reference = _model_with_grads(), _model_with_grads()
    params = list(ours.parameters())
    norm = _single_process_norm(params)
    max_norm = norm / 4
    clip_grad_by_total_norm_fp32([p.grad for p in params], max_norm, norm)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    for p, r in zip(params, reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    assert _single_process_norm(params) == pytest.approx(max_norm, rel=1e-5)


def test_clipping_leaves_small_gradients_alone():
    params = list(_model_with_grads().parameters())
    before = [p.grad.clone() for p in params]
    norm = _single_process_norm(params)
    clip_grad_by_total_norm_fp32([p.grad for p in params], norm * 2, norm)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    with pytest.raises(ValueError, match="--clip-grad"):
        clip_grad_by_total_norm_fp32([p.grad for p in params], 0.0, norm)


def _param(values, grad=None, main_grad=None, **attributes):
    param = torch.nn.Parameter(torch.zeros(len(values)))
    param.grad = None if grad is None else torch.tensor(grad)
    if main_grad is not None:
        param.main_grad = torch.tensor(main_grad)
    for name, value in attributes.items():
        setattr(param, name, value)
    return param


def test_which_grads_count():
    sharded = _param([0], grad=[1.0], tensor_model_parallel=True)
    replicated = _param([0], grad=[2.0], tensor_model_parallel=False)
    unmarked = _param([0], grad=[3.0])
    embedding = _param([0], grad=[4.0], tensor_model_parallel=True, shared_embedding=True)
    main = _param([0], grad=[5.0], main_grad=[6.0], tensor_model_parallel=True)
    no_grad = _param([0], tensor_model_parallel=True)
    params = [sharded, replicated, unmarked, embedding, main, no_grad]

    def counted(tp_rank, first_stage):
        grads = get_grads_for_norm(params, tensor_model_parallel_rank=tp_rank, is_pipeline_first_stage=first_stage)
        return [g.item() for g in grads]

    assert counted(0, True) == [1.0, 2.0, 3.0, 4.0, 6.0]  # main_grad wins over grad
    assert counted(1, True) == [1.0, 4.0, 6.0]  # replicated copies count on tensor rank 0 only
    assert counted(0, False) == [1.0, 2.0, 3.0, 6.0]  # the tied embedding counts on the first stage only
    assert counted(1, False) == [1.0, 6.0]


def test_low_precision_grads_are_summed_in_fp32():
    grads = [torch.full((4096,), 3.0, dtype=torch.bfloat16), torch.full((4096,), 4.0, dtype=torch.float16)]
    # In bf16 the sum of squares (9 * 4096 + 16 * 4096) would not even be representable exactly.
    assert get_grad_norm_fp32(grads, model_parallel_group=None) == pytest.approx(5.0 * 64, rel=1e-7)
    assert get_grad_norm_fp32(grads, model_parallel_group=None, norm_type=math.inf) == 4.0


def test_no_grads_and_non_finite_grads():
    assert get_grad_norm_fp32([], model_parallel_group=None) == 0.0
    assert get_grad_norm_fp32([], model_parallel_group=None, norm_type=math.inf) == 0.0
    assert math.isinf(get_grad_norm_fp32([torch.tensor([1.0, math.inf])], model_parallel_group=None))
    assert math.isnan(get_grad_norm_fp32([torch.tensor([1.0, math.nan])], model_parallel_group=None))
    assert math.isnan(get_grad_norm_fp32([torch.tensor([1.0, math.nan])], model_parallel_group=None,
                                         norm_type=math.inf))
    with pytest.raises(ValueError, match="norm_type"):
        get_grad_norm_fp32([], model_parallel_group=None, norm_type=0.0)


def test_count_zeros():
    grads = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([[0.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)]
    assert count_zeros_fp32(grads, model_parallel_group=None) == 3


# ---------------------------------------------------------------------------------------------
# Distributed: a fake two-layer model whose full gradients every rank can rebuild, split over
# tensor- and pipeline-parallel ranks the way the real layers split them.

VOCAB, HIDDEN, FFN, LAYERS = 12, 8, 16, 2


def _full_params():
    """name -> (shape, partition_dim or None for replicated, pipeline stage of a 2-stage split)."""
    params = {"embedding.word_embeddings.weight": ((VOCAB, HIDDEN), 0, "both")}
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        params.update({
            prefix + "norm.weight": ((HIDDEN,), None, layer),
            prefix + "fc1.weight": ((FFN, HIDDEN), 0, layer),  # column parallel
            prefix + "fc1.bias": ((FFN,), 0, layer),
            prefix + "fc2.weight": ((HIDDEN, FFN), 1, layer),  # row parallel
            prefix + "fc2.bias": ((HIDDEN,), None, layer),  # replicated: added after the all-reduce
        })
    params["decoder.final_norm.weight"] = ((HIDDEN,), None, LAYERS - 1)
    return params


def _full_grads():
    generator = torch.Generator().manual_seed(1234)
    grads = {}
    for name, (shape, _, _) in _full_params().items():
        grad = torch.randn(shape, generator=generator)
        grad.view(-1)[::5] = 0.0  # some exact zeros for count_zeros
        grads[name] = grad
    return grads


def _reference(norm_type, max_norm_fraction):
    """Single process: norm of the full model's gradients, and the gradients clipped by it."""
    grads = _full_grads()
    params = {}
    for name, grad in grads.items():
        params[name] = torch.nn.Parameter(torch.zeros_like(grad))
        params[name].grad = grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=1e9, norm_type=norm_type).item()
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=norm * max_norm_fraction, norm_type=norm_type)
    zeros = sum(int((g == 0).sum()) for g in grads.values())
    return norm, {name: p.grad for name, p in params.items()}, zeros


def _on_stage(stage_of, pipeline_rank, pipeline_size):
    if stage_of == "both":  # the tied embedding: input on the first stage, output on the last
        return pipeline_rank in (0, pipeline_size - 1)
    return pipeline_size == 1 or stage_of * pipeline_size // LAYERS == pipeline_rank


def _local_params(ps, sharded_over_dp):
    """This rank's parameters with its piece of the full gradient and the layers' attributes."""
    full = _full_grads()
    params = []
    for name, (_, partition_dim, stage_of) in _full_params().items():
        if not _on_stage(stage_of, ps.pipeline_model_parallel_rank, ps.pipeline_model_parallel_world_size):
            continue
        grad = full[name]
        if partition_dim is not None:
            grad = grad.chunk(ps.tensor_model_parallel_world_size, dim=partition_dim)[ps.tensor_model_parallel_rank]
        if sharded_over_dp:
            # The distributed optimizer's main parameters: each data-parallel rank holds a piece of the
            # flattened gradient (uneven pieces included), carrying the model parameter's attributes.
            grad = torch.tensor_split(grad.flatten(), ps.data_parallel_world_size)[ps.data_parallel_rank]
        param = torch.nn.Parameter(torch.zeros_like(grad))
        if sharded_over_dp:
            param.grad = grad.clone()
        else:
            param.main_grad = grad.clone()  # what the data-parallel wrapper's buffer provides
        param.tensor_model_parallel = partition_dim is not None
        param.shared_embedding = stage_of == "both"
        params.append((name, partition_dim, param))
    return params


def _norm_and_clip_body(rank, world_size, tp, pp, sharded_over_dp, max_norm_fraction):
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(tp, pp)
    dp_group = ps.data_parallel_group if sharded_over_dp else None
    results = {}
    for norm_type in (2.0, math.inf):
        local = _local_params(ps, sharded_over_dp)
        params = [p for _, _, p in local]
        grads_for_norm = get_grads_for_norm(params, tensor_model_parallel_rank=ps.tensor_model_parallel_rank,
                                            is_pipeline_first_stage=ps.is_pipeline_first_stage())
        with count_collectives() as counter:
            norm = get_grad_norm_fp32(grads_for_norm, model_parallel_group=ps.model_parallel_group,
                                      data_parallel_group=dp_group, norm_type=norm_type)
        zeros = count_zeros_fp32(grads_for_norm, model_parallel_group=ps.model_parallel_group,
                                 data_parallel_group=dp_group)

        # Clip every local gradient, duplicates included; compare with this rank's piece of the reference.
        all_grads = [p.grad if p.grad is not None else p.main_grad for p in params]
        clip_grad_by_total_norm_fp32(all_grads, norm * max_norm_fraction, norm)
        _, clipped, _ = _reference(norm_type, max_norm_fraction)
        max_error = 0.0
        for (name, partition_dim, _), grad in zip(local, all_grads):
            expected = clipped[name]
            if partition_dim is not None:
                expected = expected.chunk(tp, dim=partition_dim)[ps.tensor_model_parallel_rank]
            if sharded_over_dp:
                expected = torch.tensor_split(expected.flatten(), ps.data_parallel_world_size)[ps.data_parallel_rank]
            max_error = max(max_error, ((grad - expected).abs() / expected.abs().clamp_min(1e-3)).max().item())
        results[norm_type] = (norm, zeros, max_error, dict(counter.calls))
    return results


@pytest.mark.parametrize("tp, pp, dp, sharded_over_dp", [
    (2, 1, 1, False),  # tensor-parallel shards summed, replicated norms and biases counted once
    (1, 2, 1, False),  # tied embedding on both stages counted once
    (2, 2, 1, False),
    (2, 1, 2, False),  # data-parallel replicas must not be summed
    (2, 2, 2, True),  # distributed optimizer: gradient pieces summed over data-parallel ranks too
])
def test_parallel_norm_and_clipping_equal_single_process(run_distributed, tp, pp, dp, sharded_over_dp):
    per_rank = run_distributed(_norm_and_clip_body, world_size=tp * pp * dp, args=(tp, pp, sharded_over_dp, 0.25))
    for norm_type in (2.0, math.inf):
        expected_norm, _, expected_zeros = _reference(norm_type, 0.25)
        for results in per_rank:
            norm, zeros, max_error, calls = results[norm_type]
            assert norm == pytest.approx(expected_norm, rel=1e-6)
            assert zeros == expected_zeros
            assert max_error < 1e-5
            expected_calls = {("all_reduce", "model"): 1}
            if sharded_over_dp:
                expected_calls[("all_reduce", "data")] = 1
            assert calls == expected_calls
