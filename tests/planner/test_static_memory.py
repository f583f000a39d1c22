"""Parameters, gradients and optimizer state per rank: the planner's arithmetic against real chunks.

Every rank of 8-rank layouts is built in one process (``mock_parallel_state`` groups size
the shards; nothing communicates), wrapped in DistributedDataParallel as training wraps it and
given its optimizer; ``optimizer.memory_report()`` must equal the estimate byte for byte under
every sharding strategy. What ZeRO-3 gathers during a step needs a real one: 2-rank runs.
"""
import itertools
import re

import pytest

from megatron_lite.config import (SHARDING_STRATEGIES, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)
from megatron_lite.distributed import DistributedDataParallel
from megatron_lite.distributed.fully_sharded import FullyShardedUnits
from megatron_lite.model.builder import FSDP_UNIT_MODULES, build_model_chunk, count_parameters
from megatron_lite.optimizer import get_megatron_optimizer
from megatron_lite.planner.layouts import Layout
from megatron_lite.planner.memory import rank_memory
from megatron_lite.planner.parameters import fsdp_unit, rank_chunks
from megatron_lite.planner.static_memory import gradient_dtype_bytes, static_memory
from megatron_lite.process_groups.parallel_state import mock_parallel_state
from tests.distributed import run_distributed
from bench.harness import run_layouts

GPT = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000)
LLAMA = dict(GPT, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
# Multi-latent attention with a query latent, its latent norms, and a bias on its output projection.
MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, add_bias_linear=True)
# Every per-layer tensor the HF families add: Qwen2's q/k/v bias, Qwen3's and Gemma 3's q/k norms, Gemma's post norms.
FAMILY_FEATURES = dict(LLAMA, add_qkv_bias=True, qk_layernorm=True, post_sublayer_norm=True, kv_channels=32)
# A dense first layer, then mixtures of 4 experts with a gated shared expert; OLMoE's q/k norms over the projections.
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq="([0]+[1]*3)",
           moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, qk_layernorm=True,
           qk_layernorm_whole_projection=True)
# Two multi-token prediction depths (on the last stage, with a copy of the embedding) after a dense first layer
# and experts, as DeepSeek-V3's: their layers have experts, as the decoder's last; learned positions copied too.
MTP = dict(MOE, position_embedding_type="learned_absolute", mtp_num_layers=2)
# Qwen3-Next's hybrid: gated DeltaNet layers (every 4th keeps gated attention, whose q projection holds the gates).
HYBRID = dict(LLAMA, qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gdn",
              linear_attention_freq="4", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8)
WORLD = 8


def _config(arch, tp=1, pp=1, vpp=None, *, ep=1, strategy="no_shard", bf16=False, fp16=False, bucket=None,
            overlap=False, offload=False, grad_offload=False, optimizer="adam", scalar_optimizer="adam", **training):
    """--overlap-grad-reduce comes with --overlap-param-gather when sharded (Megatron's pair)."""
    return Config(model=ModelConfig(**arch),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                          data_parallel_sharding_strategy=strategy, ddp_bucket_size=bucket,
                                          overlap_grad_reduce=overlap,
                                          overlap_param_gather=overlap and strategy != "no_shard",
                                          grad_cpu_offload=grad_offload),
                  training=TrainingConfig(bf16=bf16, fp16=fp16, **training),
                  optimizer=OptimizerConfig(optimizer=optimizer, optimizer_cpu_offload=offload,
                                            muon_scalar_optimizer=scalar_optimizer),
                  data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False))


def _built(config, rank):
    """Rank ``rank``'s chunks, wrapped as ``training.loop.get_model`` wraps them, and its optimizer."""
    parallel = config.parallel
    state = mock_parallel_state(rank, WORLD, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                expert_model_parallel_size=parallel.expert_model_parallel_size)
    state.virtual_pipeline_model_parallel_size = parallel.virtual_pipeline_model_parallel_size
    chunks = [build_model_chunk(config, state, pipeline_rank=state.pipeline_model_parallel_rank, virtual_rank=v)
              for v in range(parallel.virtual_pipeline_model_parallel_size or 1)]
    wrapped = [DistributedDataParallel(c, config=parallel, data_parallel_group=state.data_parallel_group,
                                       expert_data_parallel_group=state.expert_data_parallel_group,
                                       fsdp_unit_modules=FSDP_UNIT_MODULES) for c in chunks]
    optimizer = get_megatron_optimizer(config.optimizer, wrapped, parallel_state=state, parallel_config=parallel,
                                       params_dtype=config.params_dtype)
    return state, chunks, wrapped, optimizer


LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2), (2, 4, None)]


@pytest.mark.parametrize("arch", [GPT, LLAMA, MLA, FAMILY_FEATURES, MTP, HYBRID],
                         ids=["gpt", "llama", "mla", "family-features", "mtp", "hybrid"])
@pytest.mark.parametrize("tp,pp,vpp", LAYOUTS)
def test_parameter_list_is_the_chunks_named_parameters(arch, tp, pp, vpp):
    """Names, sizes and order of every chunk's parameters, and the ZeRO-3 unit each belongs to
    (the module path of its unit, "" for the chunk itself)."""
    config = _config(arch, tp, pp, vpp)
    for rank in range(0, WORLD, tp):  # tensor-parallel ranks hold the same shapes
        state, chunks, _, _ = _built(config, rank)
        planned = rank_chunks(config, state.pipeline_model_parallel_rank)
        assert [[(s.name, s.elements) for s in c] for c in planned] == [
            [(n, p.numel()) for n, p in chunk.named_parameters()] for chunk in chunks]
        for specs, chunk in zip(planned, chunks):
            units = FullyShardedUnits.units_of(chunk, FSDP_UNIT_MODULES)
            paths = {module: path for path, module in chunk.named_modules()}
            assert [fsdp_unit(s) for s in specs] == [paths[units[p]] for p in chunk.parameters()]


def _first_experts_named_zero(name: str, first_expert: int) -> str:
    """A parameter's name with its expert renumbered from this rank's first (the planner names rank 0's)."""
    return re.sub(r"local_experts\.(\d+)", lambda m: f"local_experts.{int(m[1]) - first_expert}", name)


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 2), (1, 2, 4), (2, 2, 2)])
def test_moe_parameter_list_is_the_chunks_named_parameters(tp, pp, ep):
    """A mixture of experts' router, this rank's experts (E / ep, each split over the expert-tensor ranks), the
    shared expert and its gate, the q/k norms over whole projections: every rank's chunks, with experts marked."""
    config = _config(MOE, tp, pp, ep=ep)
    for rank in range(WORLD):
        state, chunks, _, _ = _built(config, rank)
        first = state.expert_model_parallel_rank * MOE["num_experts"] // ep
        planned = rank_chunks(config, state.pipeline_model_parallel_rank)
        assert [[(s.name, s.elements, s.expert) for s in c] for c in planned] == [
            [(_first_experts_named_zero(n, first), p.numel(), getattr(p, "expert_parallel", False))
             for n, p in chunk.named_parameters()] for chunk in chunks]


@pytest.mark.parametrize("optimizer,scalar", [("lion", "adam"), ("muon", "adam"), ("muon", "lion")])
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
@pytest.mark.parametrize("arch,tp,pp,ep", [(GPT, 2, 2, 1), (MOE, 2, 1, 2)], ids=["gpt", "moe"])
def test_lion_and_muon_state_is_what_the_planner_says(optimizer, scalar, strategy, arch, tp, pp, ep):
    """Lion's one moment; Muon's momentum for every weight matrix (GPT-2's position embedding, the routers and the
    experts among them) and the scalar optimizer's state for the rest, on every rank's shards: equal to the live
    optimizer's."""
    config = _config(arch, tp, pp, ep=ep, strategy=strategy, bf16=True, bucket=3000, optimizer=optimizer,
                     scalar_optimizer=scalar)
    for rank in range(WORLD):
        state, _, _, optimizer_ = _built(config, rank)
        planned = static_memory(config, pipeline_rank=state.pipeline_model_parallel_rank,
                                data_parallel_size=state.data_parallel_world_size,
                                data_parallel_rank=state.data_parallel_rank,
                                expert_data_parallel_rank=state.expert_data_parallel_rank)
        assert planned.optimizer_state_bytes == optimizer_.memory_report()["optimizer_state_bytes"], rank


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 2), (1, 2, 4)])
def test_every_rank_of_a_moe_layout_holds_what_the_planner_says(strategy, tp, pp, ep):
    """Dense weights sharded over the data-parallel ranks, experts over the expert-data-parallel ones (dp x tp /
    (ep x etp)), each in buffers of their own: bytes, buckets and optimizer elements equal the live ones."""
    config = _config(MOE, tp, pp, ep=ep, strategy=strategy, bf16=True, bucket=3000)
    for rank in range(WORLD):
        state, _, wrapped, optimizer = _built(config, rank)
        report = optimizer.memory_report()
        planned = static_memory(config, pipeline_rank=state.pipeline_model_parallel_rank,
                                data_parallel_size=state.data_parallel_world_size,
                                data_parallel_rank=state.data_parallel_rank,
                                expert_data_parallel_rank=state.expert_data_parallel_rank)
        assert (planned.parameter_bytes, planned.gradient_bytes, planned.optimizer_state_bytes) == (
            report["parameter_bytes"], report["gradient_bytes"], report["optimizer_state_bytes"])
        assert (planned.bucket_elements, planned.expert_bucket_elements) == tuple(
            tuple(b.numel for chunk in wrapped for b in chunk._buckets_of(sharding(chunk)))
            for sharding in (lambda c: c.sharding, lambda c: c.expert_sharding))
        assert planned.optimizer_elements == sum(r.end - r.start for r in optimizer.param_ranges)


# Each ModelConfig field that changes what a chunk holds, on a tiny model.
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200)
FIELDS = {"gpt": {}, "rmsnorm": dict(normalization="RMSNorm"), "no-bias": dict(add_bias_linear=False),
          "qkv-bias": dict(add_bias_linear=False, add_qkv_bias=True), "qk-layernorm": dict(qk_layernorm=True),
          "qk-rmsnorm": dict(qk_layernorm=True, normalization="RMSNorm"), "kv-channels": dict(kv_channels=16),
          "query-groups": dict(num_query_groups=2), "ffn-hidden": dict(ffn_hidden_size=48),
          "swiglu": dict(swiglu=True, ffn_hidden_size=48), "geglu": dict(swiglu=True, geglu=True, ffn_hidden_size=48),
          "post-sublayer-norm": dict(post_sublayer_norm=True),
          "olmo-norms": dict(post_sublayer_norm=True, no_pre_sublayer_norm=True),
          "untied": dict(untie_embeddings_and_output_weights=True),
          "rope": dict(position_embedding_type="rope"), "max-positions": dict(max_position_embeddings=64),
          "vocab-padding": dict(make_vocab_size_divisible_by=1),
          # gpt-oss's: sinks per head, biased router and experts (fc1's split with its rows, fc2's whole).
          "sinks": dict(softmax_type="learnable"),
          "moe-biases": dict(num_experts=4, swiglu=True, moe_ffn_hidden_size=16, quick_geglu=True),
          # Llama 4's: a NoPE dense layer, then chunked attention with weightless q/k norms and top-1 experts fed
          # their routing weight, beside a shared expert as wide.
          "llama4": dict(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False, swiglu=True,
                         ffn_hidden_size=48, no_rope_freq="[1, 0]", attention_chunk_size=4, qk_l2_norm=True,
                         attn_temperature_tuning=True, num_experts=4, moe_router_topk=1,
                         moe_router_score_function="sigmoid", moe_apply_probs_on_input=True, moe_ffn_hidden_size=16,
                         moe_shared_expert_intermediate_size=16, moe_layer_freq="[0,1]")}


@pytest.mark.parametrize("field", FIELDS)
def test_the_parameter_count_follows_every_model_field(field):
    """The planner's parameters against the real chunks' ``sum(p.numel())`` (and each name and size), on every
    rank of tp 2 x pp 2: the biases, norms and widths each field adds or removes, split as the model splits them."""
    config = _config(dict(TINY, **FIELDS[field]), tp=2, pp=2)
    for rank in range(0, WORLD, 2):
        state, chunks, _, _ = _built(config, rank)
        planned = rank_chunks(config, state.pipeline_model_parallel_rank)
        assert sum(s.elements for c in planned for s in c) == sum(p.numel() for c in chunks for p in c.parameters())
        assert [[(s.name, s.elements) for s in c] for c in planned] == [
            [(n, p.numel()) for n, p in chunk.named_parameters()] for chunk in chunks]


CASES = {"fp32": {}, "bf16": dict(bf16=True), "fp16": dict(fp16=True), "bucket=3000": dict(bucket=3000),
         "bf16-bucket=5000": dict(bf16=True, bucket=5000), "overlap": dict(overlap=True),
         "offload": dict(offload=True), "sgd-bf16": dict(optimizer="sgd", bf16=True),
         "bf16-grad-offload": dict(bf16=True, offload=True, grad_offload=True)}
SHARDS_GRADIENTS = ("optim_grads", "optim_grads_params")


@pytest.mark.parametrize("strategy,case", [(s, c) for s, c in itertools.product(SHARDING_STRATEGIES, CASES)
                                           if s in SHARDS_GRADIENTS or not CASES[c].get("grad_offload")])
@pytest.mark.parametrize("tp,pp,vpp", [(1, 1, None), (2, 2, None), (1, 2, 2)])
def test_every_rank_holds_what_the_planner_says(strategy, case, tp, pp, vpp):
    """Parameters, gradients and optimizer state, the buckets, and the elements each rank's optimizer
    updates, at start-up (what is there for the whole run; ZeRO-3's gathers come during a step, below)."""
    config = _config(GPT, tp, pp, vpp, strategy=strategy, **CASES[case])
    for rank in range(WORLD):
        state, _, wrapped, optimizer = _built(config, rank)
        report = optimizer.memory_report()
        planned = static_memory(config, pipeline_rank=state.pipeline_model_parallel_rank,
                                data_parallel_size=state.data_parallel_world_size,
                                data_parallel_rank=state.data_parallel_rank)
        assert (planned.parameter_bytes, planned.gradient_bytes, planned.optimizer_state_bytes,
                planned.optimizer_state_on_host) == (report["parameter_bytes"], report["gradient_bytes"],
                                                     report["optimizer_state_bytes"], report["optimizer_state_on_host"])
        assert planned.bucket_elements == tuple(b.numel for chunk in wrapped for b in chunk.buckets)
        assert planned.optimizer_elements == sum(r.end - r.start for r in optimizer.param_ranges)
        shards = [b.grad_shard_data for chunk in wrapped for b in chunk.grad_buffers if b.grad_shard_data is not None]
        on_host = sum(s.numel() * s.element_size() for s in shards) if config.parallel.grad_cpu_offload else 0
        assert planned.host_gradient_bytes == on_host
        if strategy != "optim_grads_params":
            assert planned.peak_parameter_bytes == planned.parameter_bytes


def _step_config(strategy, tp=1, pp=1, vpp=None, *, tied=True, recompute=None, **options):
    """A 4-layer GPT for a step on 2 ranks: 2 micro-batches per data-parallel rank (4 without data parallelism)."""
    method, layers = recompute or (None, None)
    arch = dict(GPT, seq_length=32, vocab_size=256, untie_embeddings_and_output_weights=not tied)
    return _config(arch, tp, pp, vpp, strategy=strategy, micro_batch_size=2, global_batch_size=8,
                   recompute_granularity=recompute and "full", recompute_method=method, recompute_num_layers=layers,
                   **options)


STEPS = {"zero3": _step_config("optim_grads_params"),
         "zero3-prefetch": _step_config("optim_grads_params", overlap=True),
         "zero3-untied-prefetch-full-2": _step_config("optim_grads_params", tied=False, overlap=True,
                                                      recompute=("uniform", 2)),
         "zero3-untied-full-3": _step_config("optim_grads_params", tied=False, recompute=("uniform", 3)),
         "zero3-prefetch-block-2": _step_config("optim_grads_params", overlap=True, recompute=("block", 2)),
         "zero3-pp2-interleaved-prefetch": _step_config("optim_grads_params", pp=2, vpp=2, overlap=True),
         "zero3-pp2-full-2": _step_config("optim_grads_params", pp=2, recompute=("uniform", 2)),
         "zero3-tp2-prefetch": _step_config("optim_grads_params", tp=2, overlap=True),
         "zero3-bf16-grad-offload": _step_config("optim_grads_params", bf16=True, offload=True, grad_offload=True),
         "zero2-bucket=3000-overlap": _step_config("optim_grads", bucket=3000, overlap=True),
         "zero2-pp2-interleaved-bucket=3000": _step_config("optim_grads", pp=2, vpp=2, bucket=3000),
         "zero1-bf16-overlap": _step_config("optim", bf16=True, overlap=True),
         "no_shard-pp2": _step_config("no_shard", pp=2)}


@pytest.fixture(scope="module")
def stepped():
    """One training step of every STEPS config on 2 gloo ranks (about 10 s)."""
    return run_distributed(run_layouts, 2, args=(list(STEPS.values()),))


@pytest.mark.parametrize("name", STEPS)
def test_after_a_step_and_at_the_peak_of_zero3_gathers(stepped, name):
    """After a training step nothing more is held, and the parameters' peak (ZeRO-3: the shard plus the
    units whole at once, measured at every gather) is the estimate's, for every rank."""
    config = STEPS[name]
    index = list(STEPS).index(name)
    for results in stepped:
        got = results[index]
        planned = rank_memory(Layout(config, 2), device="cpu", pipeline_rank=got["pipeline_rank"],
                              data_parallel_rank=got["data_parallel_rank"]).static
        report = got["memory_report"]
        assert (planned.parameter_bytes, planned.peak_parameter_bytes, planned.gradient_bytes,
                planned.optimizer_state_bytes) == (report["parameter_bytes"], report["peak_parameter_bytes"],
                                                   report["gradient_bytes"], report["optimizer_state_bytes"])
        gathers = config.parallel.data_parallel_sharding_strategy == "optim_grads_params"
        assert (planned.peak_parameter_bytes > planned.parameter_bytes) == gathers


@pytest.mark.parametrize("bf16,fp16,unsharded,optim,optim_grads,optim_grads_params",
                         [(False, False, 16, (8, 8), (4, 12), 16), (True, False, 18, (6, 12), (2, 16), 18),
                          (False, True, 20, (4, 16), (2, 18), 20)])
def test_bytes_per_parameter_follow_the_reference_table(bf16, fp16, unsharded, optim, optim_grads, optim_grads_params):
    """docs/reference.md section 6 for a model big enough that padding is noise: 16/18/20 bytes, and
    fixed + sharded/d with the distributed optimizer; ZeRO-2 shards the gradients too and ZeRO-3
    everything (besides what ZeRO-2/3 stage and ZeRO-3 gathers, below)."""
    arch = dict(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=16, vocab_size=50000)
    elements = count_parameters(_config(arch)).total
    d = 8
    expected = {"no_shard": unsharded, "optim": optim[0] + optim[1] / d,
                "optim_grads": optim_grads[0] + optim_grads[1] / d, "optim_grads_params": optim_grads_params / d}
    for strategy, per_parameter in expected.items():
        config = _config(arch, strategy=strategy, bf16=bf16, fp16=fp16)
        memory = static_memory(config, pipeline_rank=0, data_parallel_size=d)
        gradients = memory.gradient_bytes
        if strategy in SHARDS_GRADIENTS:  # the shard, without the staging buffers
            gradients = sum(memory.bucket_elements) // d * gradient_dtype_bytes(config)
        total = memory.parameter_bytes + gradients + memory.optimizer_state_bytes
        assert total / elements == pytest.approx(per_parameter, rel=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_stages_shard_more_and_more(overlap):
    """ZeRO-2 keeps a gradient shard plus one bucket-sized staging buffer (two when overlapping: one
    filling, one reducing); ZeRO-3 a parameter shard, which a step's gathers raise by the units whole at
    once: on one stage the tied embedding (whole from the output layer's backward to its own) and the
    running layer, plus the prefetched one when overlapping."""
    arch = dict(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=16, vocab_size=32000)
    d = 64
    by = {s: static_memory(_config(arch, strategy=s, bf16=True, bucket=1, overlap=overlap), pipeline_rank=0,
                           data_parallel_size=d) for s in SHARDING_STRATEGIES}
    psi = count_parameters(_config(arch)).total
    word, embedding, layer = 32000 * 1024, (32000 + 16) * 1024, 12 * 1024 ** 2 + 13 * 1024
    in_flight = 1 + overlap
    assert by["no_shard"].gradient_bytes == 4 * psi
    assert by["optim"].gradient_bytes == pytest.approx(4 * psi, rel=1e-3)
    assert by["optim_grads"].optimizer_state_bytes == by["optim"].optimizer_state_bytes
    # --ddp-bucket-size 1: a bucket per parameter, the largest the word embedding.
    assert by["optim_grads"].gradient_bytes == pytest.approx(4 * (psi / d + in_flight * word), rel=1e-3)
    # ZeRO-3's buckets are its units whatever the bucket size: the largest is the embedding.
    assert by["optim_grads_params"].gradient_bytes == pytest.approx(4 * (psi / d + in_flight * embedding), rel=1e-3)
    assert by["optim_grads_params"].parameter_bytes == pytest.approx(2 * psi / d, rel=1e-3)
    assert by["optim_grads_params"].peak_parameter_bytes == pytest.approx(
        2 * (psi / d + embedding + in_flight * layer), rel=1e-3)
    assert [by[s].device_bytes for s in SHARDING_STRATEGIES] == sorted(
        (by[s].device_bytes for s in SHARDING_STRATEGIES), reverse=True)
