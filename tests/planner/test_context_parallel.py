"""The planner under context parallelism: activations per rank, the key/value exchange, enumeration.

Measured with the planner's own activation counter (``harness.SavedActivationPeak``) on 4 gloo ranks:
p2p keeps 1/cp of one rank's activations (the ring's blocks are never kept), all_gather adds the
whole sequence's keys and values; the estimate follows both within the bound the other layouts meet, for
grouped-query and multi-latent attention and Llama 4's chunked layers (whose all_gather core attends chunk by
chunk, ``AllGatherCalls``), and static memory (ZeRO over the data x context ranks) exactly.
"""
import dataclasses

import pytest

from megatron_lite.config import Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.planner.cluster import PRESETS, customise
from megatron_lite.planner.estimate import estimate, estimate_for_config
from megatron_lite.planner.layouts import Layout, enumerate_layouts
from megatron_lite.planner.memory import rank_memory
from megatron_lite.planner.step_time import ring_step_pairs
from tests.distributed import run_distributed
from bench.harness import run_layouts
from tests.planner.test_activations import TOLERANCE

GPT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=256, hidden_dropout=0.1,
           attention_dropout=0.0)
LLAMA = dict(GPT, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=160)
# Multi-latent attention: the ranks exchange its expanded keys (16 + 8 channels) and values (16) per head.
MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True)
# Llama 4: a chunked layer (chunks of 12: a rank's chunk of 32 or 16 positions starts inside one) and a NoPE one.
LLAMA4 = dict(LLAMA, attention_chunk_size=12, no_rope_freq="[0, 1]")


def _config(model: dict, cp: int, comm: str = "p2p", sharded: bool = False) -> Config:
    return Config(model=ModelConfig(**model),
                  parallel=ParallelConfig(context_parallel_size=cp, cp_comm_type=[comm],
                                          use_distributed_optimizer=sharded, ddp_bucket_size=3000 if sharded else None),
                  training=TrainingConfig(micro_batch_size=2, global_batch_size=8), data=DataConfig(mock_data=True),
                  logging=LoggingConfig(log_memory=False))


LAYOUTS = {("gpt", 1, "p2p"): _config(GPT, 1), ("gpt", 2, "p2p"): _config(GPT, 2), ("gpt", 4, "p2p"): _config(GPT, 4),
           ("gpt", 2, "all_gather"): _config(GPT, 2, "all_gather", sharded=True),
           ("llama", 1, "p2p"): _config(LLAMA, 1), ("llama", 2, "p2p"): _config(LLAMA, 2),
           ("llama", 4, "all_gather"): _config(LLAMA, 4, "all_gather"),
           ("mla", 1, "p2p"): _config(MLA, 1), ("mla", 2, "p2p"): _config(MLA, 2),
           ("mla", 2, "all_gather"): _config(MLA, 2, "all_gather"),
           ("llama4", 1, "p2p"): _config(LLAMA4, 1), ("llama4", 2, "all_gather"): _config(LLAMA4, 2, "all_gather"),
           ("llama4", 4, "all_gather"): _config(LLAMA4, 4, "all_gather"), ("llama4", 4, "p2p"): _config(LLAMA4, 4)}


@pytest.fixture(scope="module")
def measured():
    """One training step of each layout on 4 gloo ranks, by layout."""
    per_rank = run_distributed(run_layouts, 4, args=(list(LAYOUTS.values()),), timeout=900)
    return {name: [rank[index] for rank in per_rank] for index, name in enumerate(LAYOUTS)}


def test_activations_per_rank_shrink_with_cp_and_match_the_estimate(measured):
    for (model, cp, comm), config in LAYOUTS.items():
        layout = Layout(config, 4)
        for rank, got in enumerate(measured[(model, cp, comm)]):
            planned = rank_memory(layout, device="cpu", pipeline_rank=0,
                                  data_parallel_rank=got["data_parallel_rank"] * cp + rank % cp)
            report = got["memory_report"]
            assert (report["parameter_bytes"], report["gradient_bytes"], report["optimizer_state_bytes"]) == (
                planned.static.parameter_bytes, planned.static.gradient_bytes, planned.static.optimizer_state_bytes)
            assert planned.activation_bytes / got["activation_peak"] == pytest.approx(1.0, abs=TOLERANCE)
        whole = measured[(model, 1, "p2p")][0]["activation_peak"]
        ratio = measured[(model, cp, comm)][0]["activation_peak"] / whole
        if comm == "p2p" and model == "mla" and cp > 1:  # measured 0.40 at cp2: in one process its core keeps
            assert ratio < 1 / cp, (model, cp, ratio)  # the s^2 scores (the CPU flash kernel takes no narrower values)
        elif comm == "p2p" and model == "llama4" and cp > 1:  # measured 0.237 at cp4: in one process the chunked
            assert 0.9 / cp < ratio < 1 / cp, (model, cp, ratio)  # layer's fold copies its queries, keys and values
        elif comm == "p2p":  # measured: exactly 1/cp
            assert ratio == pytest.approx(1 / cp, rel=0.05), (model, cp, ratio)
        else:  # the gathered keys and values come on top (measured 0.63 at cp2, 0.33 at cp4 with GQA, 0.53 at
            # cp2 with multi-latent attention, 0.54 and 0.28 with Llama 4's chunks)
            assert 1 / cp < ratio < 1.5 / cp, (model, cp, ratio)


def test_key_value_exchange_in_the_step_time():
    """A long sequence: cp layouts are enumerated, each with its exchange in the step time; all_gather's
    exchange is all exposed, p2p's hides behind the blocks' attention."""
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                        seq_length=32768, vocab_size=32000, attention_dropout=0.0)
    base = Config(model=model, training=TrainingConfig(global_batch_size=8, bf16=True))
    cluster = customise(PRESETS["h100-80g"], num_gpus=8)
    layouts = list(enumerate_layouts(base, cluster))
    assert {layout.context_parallel_size for layout in layouts} == {1, 2, 4, 8}
    cp4 = next(layout for layout in layouts if layout.context_parallel_size == 4
               and layout.tensor_model_parallel_size == 2 and layout.recompute == "none")
    assert "--context-parallel-size 4 --cp-comm-type p2p" in cp4.flags()
    ring = estimate(cp4, cluster).time.breakdown["context_parallel"]
    gathered = estimate(Layout(dataclasses.replace(cp4.config, parallel=dataclasses.replace(
        cp4.config.parallel, cp_comm_type=["all_gather"])), 8), cluster).time.breakdown["context_parallel"]
    assert 0 < ring < gathered
    # Multi-latent attention exchanges its heads' expanded keys and values: 16 x (16 + 8 + 8) channels per token,
    # as many as the grouped-query model's 2 x 4 x 64, so the same time.
    latent = dataclasses.replace(model, num_query_groups=None, position_embedding_type="rope",
                                 multi_latent_attention=True, q_lora_rank=256, kv_lora_rank=128, qk_head_dim=16,
                                 qk_pos_emb_head_dim=8, v_head_dim=8)
    latent_gathered = estimate(Layout(dataclasses.replace(cp4.config, model=latent, parallel=dataclasses.replace(
        cp4.config.parallel, cp_comm_type=["all_gather"])), 8), cluster).time.breakdown["context_parallel"]
    assert latent_gathered == pytest.approx(gathered)
    short = dataclasses.replace(base, model=dataclasses.replace(model, seq_length=2048))
    assert {layout.context_parallel_size for layout in enumerate_layouts(short, cluster)} == {1}


def test_chunked_layers_ring_hides_its_messages_behind_less():
    """Llama 4's chunks of 12288 over 32768 positions at cp4 (8 chunks of 4096 of the sequence): a rank attends to
    3 to 6 pairs of its chunks and a step's owner's (9 without chunks), most steps to none, so the ring's messages
    hide behind fewer blocks: more of the p2p exchange is exposed than without chunks, while all_gather's is the
    same; the layer's FLOPs are its chunks'. (tests/context_parallel/test_attention.py checks ``ring_step_pairs``
    against the pairs the ring attends to.)"""
    model = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                        seq_length=32768, vocab_size=32000, attention_dropout=0.0, position_embedding_type="rope")
    chunked = dataclasses.replace(model, attention_chunk_size=12288, no_rope_freq="4")
    assert ring_step_pairs(chunked, 4, 0) == [[2, 0, 0, 1], [2, 1, 0, 0], [2, 1, 1, 2], [3, 0, 0, 0]]
    assert ring_step_pairs(chunked, 4, 3) is None  # the NoPE layer attends to the whole sequence
    cluster = customise(PRESETS["h100-80g"], num_gpus=8)

    def exchange(model, comm):
        config = Config(model=model, parallel=ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=4,
                                                             cp_comm_type=[comm]),
                        training=TrainingConfig(global_batch_size=8, bf16=True))
        result = estimate(Layout(config, 8), cluster).time.breakdown
        return result["context_parallel"], result["compute"]

    (ring, compute), (chunked_ring, chunked_compute) = exchange(model, "p2p"), exchange(chunked, "p2p")
    assert chunked_ring > ring and chunked_compute < compute
    assert exchange(chunked, "all_gather")[0] == pytest.approx(exchange(model, "all_gather")[0])


def test_estimate_for_a_run_counts_its_shard_in_the_data_context_group():
    """ZeRO shards over data x context ranks: rank 1 (context rank 1 of data rank 0) owns shard 1 of 4."""
    config = _config(GPT, 2, sharded=True)
    shards = [estimate_for_config(config, 4, rank=rank, device="cpu").static.optimizer_state_bytes
              for rank in range(4)]
    whole = estimate_for_config(_config(GPT, 1), 1, device="cpu").static.optimizer_state_bytes
    assert sum(shards) >= whole and max(shards) < whole / 2
