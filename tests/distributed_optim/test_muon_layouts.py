"""Muon under every parallel layout equals one process (1e-5, float32 Newton-Schulz).

A 2-layer Llama (GQA, SwiGLU: fused QKV and [gate; up] split per matrix) trains 4 steps with --optimizer muon
through ``pretrain`` at tp2 (--muon-tp-mode duplicated and distributed), pp2, and dp2 under the distributed
optimizer (ZeRO-1) and ZeRO-3, where a matrix is orthogonalised whole by the one data-parallel rank that owns it;
LoRA's adapter matrices train with Muon at tp2 as at one process; --muon-tp-mode blockwise at tp2 differs
from one process (the documented price of needing no communication).
"""
from unittest import mock

import pytest

from megatron_lite.config import (Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                  PeftConfig, TrainingConfig)
from megatron_lite.optimizer import muon
from tests.distributed import run_distributed
from tests.parity import assert_losses_match, assert_relative_close, full_tensors, rank_tensors

STEPS = 4


def _config(tp=1, pp=1, strategy="no_shard", tp_mode="duplicated", lora=False) -> Config:
    return Config(
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                          seq_length=16, vocab_size=64, make_vocab_size_divisible_by=32, normalization="RMSNorm",
                          position_embedding_type="rope",
                          swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                          hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                data_parallel_sharding_strategy=strategy, ddp_bucket_size=3000),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=STEPS),
        # Adam's eps at 1e-6 for the embedding and output rows of tokens the batch lacks: their gradients are
        # rounding noise, which eps 1e-8 turns into lr-sized steps (test_3d_equivalence.py says more).
        optimizer=OptimizerConfig(optimizer="muon", lr=1e-2, clip_grad=0.5, lr_decay_style="constant", adam_eps=1e-6,
                                  muon_fp32_matmul_prec="high", muon_tp_mode=tp_mode, muon_nesterov=True),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=STEPS, log_memory=False),
        peft=PeftConfig(peft="lora", lora_rank=4) if lora else PeftConfig())


def _train(rank, world_size, layouts):
    from megatron_lite.training.loop import pretrain

    results = []
    for layout in layouts:
        with mock.patch.object(muon, "newton_schulz", wraps=muon.newton_schulz) as newton_schulz:
            state, chunks, parallel_state = pretrain(_config(**layout), keep_process_group=True)
        tensors = {}
        for chunk in chunks:
            chunk.finish_param_sync()
            with chunk.gathered_parameters():
                tensors.update(rank_tensors(chunk.module.named_parameters()))
        results.append({"losses": state.losses, "tensors": tensors, "ns_calls": newton_schulz.call_count,
                        "tp_rank": parallel_state.tensor_model_parallel_rank})
    return results


@pytest.fixture(scope="module")
def references():
    (result,) = run_distributed(_train, 1, args=([{}, {"lora": True}],))
    return [(run["losses"], full_tensors([run])) for run in result]


@pytest.fixture(scope="module")
def single_process(references):
    return references[0]


def _run(world_size, layouts):
    per_rank = run_distributed(_train, world_size, args=(layouts,), timeout=600)
    return [[r[i] for r in per_rank] for i in range(len(layouts))]


def _assert_matches(results, single_process, what):
    losses, weights = single_process
    assert_losses_match([r["losses"] for r in results], losses, STEPS, what)
    for name, value in full_tensors(results).items():
        assert_relative_close(value, weights[name], what=f"{what} {name}")


def test_tensor_and_pipeline_parallel_match_one_process(references):
    single_process, lora = references
    layouts = [{"tp": 2, "tp_mode": "duplicated"}, {"tp": 2, "tp_mode": "distributed"}, {"pp": 2},
               {"tp": 2, "tp_mode": "distributed", "lora": True}, {"tp": 2, "tp_mode": "blockwise"}]
    *equal, blockwise = _run(2, layouts)
    for layout, results in zip(layouts, equal):
        _assert_matches(results, lora if layout.get("lora") else single_process, str(layout))
    # LoRA trained something else than the whole model did (its adapters, with Muon: they are 2-D).
    assert lora[0] != single_process[0]
    with pytest.raises(AssertionError):
        _assert_matches(blockwise, single_process, "blockwise")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_sharded_optimizer_orthogonalises_each_matrix_once_and_matches_one_process(single_process, strategy):
    (results,) = _run(2, [{"strategy": strategy}])
    _assert_matches(results, single_process, strategy)
    # Each matrix once per step over both ranks (2 layers x q, k, v, proj, gate, up, fc2), shared between them.
    calls = [r["ns_calls"] for r in results]
    assert sum(calls) == 2 * 7 * STEPS and min(calls) > 0, calls
