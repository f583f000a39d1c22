"""Fine-tuning under tensor, pipeline and data parallelism trains like one process.

A Llama-style model (rotary positions, grouped-query attention) fine-tunes 3 steps on chat data with
responses of different lengths, so micro-batches and data-parallel replicas hold different numbers of
loss tokens: only the per-token mean over the global batch makes every layout agree. Packed data
carries its documents (each attending in a row of its own) and restarted positions through tensor, sequence and
pipeline parallelism (and the interleaved schedule). Under ZeRO-2/3 the division by the global token
count acts on each rank's gradient shards (in host memory with --grad-cpu-offload). Adam hides a
wrong gradient scale (its update is nearly scale-invariant), and so does clipping to a norm of 1, so
every layout also trains with SGD, unclipped.
"""
import json
import random

import pytest

from megatron_lite.config import (Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                  TrainingConfig)
from tests.distributed import run_distributed
from tests.parity import assert_losses_match

STEPS = 3


def _write_data(path) -> str:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(40):
            prompt = [rng.randint(0, 60) for _ in range(rng.randint(1, 6))]
            response = [rng.randint(0, 60) for _ in range(rng.randint(1, 6))]
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(map(str, prompt))},
                                             {"role": "assistant", "content": " ".join(map(str, response))}]}) + "\n")
    return str(path)


def _config(data: str, *, tp: int = 1, pp: int = 1, pack: bool = True, sharded: bool = False,
            vpp_layers: int | None = None, strategy: str | None = None, offload: bool = False,
            optimizer: str = "adam") -> Config:
    return Config(
        model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
                          vocab_size=64, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                          add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                          attention_dropout=0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                sequence_parallel=tp > 1, use_distributed_optimizer=sharded,
                                data_parallel_sharding_strategy=strategy, grad_cpu_offload=offload,
                                num_layers_per_virtual_pipeline_stage=vpp_layers),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS),
        # Adam's eps above float32 noise, as the 3D ladder explains.
        optimizer=OptimizerConfig(optimizer=optimizer, lr=1e-2, adam_eps=1e-6, optimizer_cpu_offload=offload,
                                  clip_grad=1.0 if optimizer == "adam" else 0.0),
        data=DataConfig(sft=True, train_data_path=[data], tokenizer_type="NullTokenizer", sft_pack_sequences=pack),
        logging=LoggingConfig(log_interval=STEPS, log_memory=False))


def _train(rank, world_size, data, layouts):
    from megatron_lite.training.loop import pretrain

    return [pretrain(_config(data, **layout), keep_process_group=True)[0].losses for layout in layouts]


LAYOUTS = [dict(tp=2, pp=2), dict(pp=2, vpp_layers=1), dict(tp=2, sharded=True), dict(pp=2, pack=False),
           dict(tp=2, strategy="optim_grads", offload=True), dict(strategy="optim_grads_params", pack=False)]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("pack", [True, False])
def test_sft_layouts_match_single_process(tmp_path, pack, optimizer):
    data = _write_data(tmp_path / "chat.jsonl")
    layouts = [dict(layout, optimizer=optimizer) for layout in LAYOUTS if layout.get("pack", True) == pack]
    (reference,) = run_distributed(_train, 1, args=(data, [dict(pack=pack, optimizer=optimizer)]))
    per_rank = run_distributed(_train, 4, args=(data, layouts), timeout=600)
    for index, layout in enumerate(layouts):
        assert_losses_match([rank_losses[index] for rank_losses in per_rank], reference[0], STEPS, f"{layout}")
