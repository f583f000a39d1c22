"""--calculate-per-token-loss: the loss is summed over tokens and divided by the global token count.

Uneven loss masks (a micro-batch with few loss tokens, one with none) make the difference
visible: the per-token loss and its gradients must equal one process computing
sum(loss x mask) / sum(mask) over the whole global batch in plain PyTorch, under data and
pipeline parallelism; without the flag, the gradient is the mean of the micro-batches' means
(Megatron's default) and differs.
"""
import pytest
import torch

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig
from tests.distributed import run_distributed
from tests.parity import assert_relative_close

GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 8, 2, 8, 128


def _config(pp=1, per_token=True, strategy="no_shard") -> Config:
    return Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                                    vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, data_parallel_sharding_strategy=strategy),
                  training=TrainingConfig(micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, train_iters=1,
                                          calculate_per_token_loss=per_token),
                  data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))


def _global_batch() -> dict:
    """Random tokens; loss masks keep from all to none of a sample's tokens."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    keep = torch.tensor([1.0, 0.9, 0.1, 0.0, 0.0, 0.0, 0.5, 0.3]).unsqueeze(1)  # samples 3-5: a micro-batch of none
    loss_mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=generator) < keep).float()
    positions = torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ).contiguous()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": positions}


def _micro_batches(data_parallel_rank: int, data_parallel_size: int):
    """This rank's micro-batches in Megatron's sampler order (step k, rank r: the r-th slice)."""
    batch = _global_batch()
    for start in range(0, GLOBAL_BATCH, MICRO_BATCH * data_parallel_size):
        first = start + data_parallel_rank * MICRO_BATCH
        yield {k: v[first:first + MICRO_BATCH] for k, v in batch.items()}


def _reference(per_token: bool):
    """Plain PyTorch on the whole batch: the per-token mean, or the mean of the micro-batches' means."""
    from megatron_lite.model.builder import build_model
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel

    (model,) = build_model(_config(), initialize_model_parallel(1, 1))
    batch = _global_batch()
    per_token_loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    masked, mask = per_token_loss * batch["loss_mask"], batch["loss_mask"]
    if per_token:
        loss = masked.sum() / mask.sum()
    else:
        sums = masked.reshape(-1, MICRO_BATCH * SEQ).sum(1)
        counts = mask.reshape(-1, MICRO_BATCH * SEQ).sum(1).clamp(min=1)
        loss = (sums / counts).mean()
    loss.backward()
    report = (masked.sum() / mask.sum()).item()  # what the log shows either way
    return report, {name: p.grad.clone() for name, p in model.named_parameters()}


def _one_iteration(rank, world_size, layouts):
    from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_lite.training import loop

    results = []
    for layout in layouts:
        config = _config(**layout)
        ps = initialize_model_parallel(1, config.parallel.pipeline_model_parallel_size)
        chunks = loop.get_model(config, ps)
        losses = loop._forward_backward(config, ps, chunks, _micro_batches(ps.data_parallel_rank,
                                                                           ps.data_parallel_world_size),
                                        config.training.num_microbatches(ps.data_parallel_world_size),
                                        forward_only=False)
        grads = {}
        for chunk in chunks:  # finalize_model_grads has run: the slices hold the final gradients
            for name, grad in _full_gradients(chunk, ps).items():
                grads["embedding.word_embeddings.weight" if name == "output_layer.weight" else name] = grad
        results.append({"loss": loop._average_loss(losses, ps), "grads": grads})
        destroy_model_parallel(ps)
    return results


def _full_gradients(chunk, ps) -> dict:
    """name -> whole gradient; under a sharding strategy each rank holds a disjoint shard: sum them."""
    from megatron_lite.process_groups import collectives

    names = {param: name for name, param in chunk.module.named_parameters()}
    # Every rank makes every parameter's tensor (a shard may hold none of one), in the same order.
    grads = {names[param]: torch.zeros(bucket.layout[param][1]) for bucket in chunk.buckets for param in bucket.params}
    for piece in chunk.param_slices():
        grads[names[piece.param]].view(-1)[piece.start:piece.end] = piece.grad.float()
    if chunk.config.use_distributed_optimizer:
        for grad in grads.values():
            collectives.all_reduce(grad, ps.data_parallel_group)
    return grads


@pytest.fixture(scope="module")
def reference():
    return {per_token: _reference(per_token) for per_token in (True, False)}


def _check(result, reference_loss, reference_grads, what):
    if result["loss"] is not None:
        assert result["loss"] == pytest.approx(reference_loss, rel=1e-6), what
    for name, grad in result["grads"].items():
        assert_relative_close(grad, reference_grads[name], what=f"{what} {name}")


@pytest.mark.parametrize("layout", [dict(pp=1), dict(strategy="optim"), dict(strategy="optim_grads_params"),
                                    dict(pp=2)], ids=["dp2", "dp2-zero1", "dp2-zero3", "pp2"])
def test_per_token_loss_equals_the_full_batch_mean(reference, layout):
    results = run_distributed(_one_iteration, 2, args=([layout, dict(layout, per_token=False)],))
    for rank, (per_token, default) in enumerate(results):
        _check(per_token, *reference[True], what=f"{layout} rank {rank} per-token")
        _check(default, *reference[False], what=f"{layout} rank {rank} default")


def test_one_process_and_the_flag_matters(reference):
    (result,) = run_distributed(_one_iteration, 1, args=([dict(pp=1)],))
    _check(result[0], *reference[True], what="one process")
    per_token_grads, default_grads = reference[True][1], reference[False][1]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.allclose(per_token_grads[name], default_grads[name], rtol=1e-2)
