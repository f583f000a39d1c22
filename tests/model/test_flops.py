"""The FLOPs the log's throughput and the planner charge (``model/flops.py``) equal the matmuls a forward pass
of the real model runs: GPT-2, Llama with grouped-query attention, and multi-latent attention with and without
a query latent, and Llama 4's layers (a NoPE layer with a dense MLP, a RoPE layer with top-1 experts on their
inputs and a shared expert). Every linear layer goes through ``F.linear`` and the explicit attention path through
``torch.baddbmm`` / ``torch.bmm``; those are wrapped to add up 2 x (output elements) x (inner width) of each
call (torch's FlopCounterMode counts the same, but its first use imports torch._dynamo, seconds on a CPU)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model import GPTModel, flops
from megatron_lite.tensor_parallel import TensorParallelConfig

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, hidden_dropout=0.0,
            attention_dropout=0.0, attention_backend="unfused")
LLAMA = dict(BASE, normalization="RMSNorm", position_embedding_type="rope", swiglu=True, ffn_hidden_size=64,
             add_bias_linear=False)
MLA = dict(LLAMA, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           qk_layernorm=True)
# Chunks as long as the sequence: the explicit path multiplies whole score matrices, and chunks count their own
# (``test_chunked_layers_count_their_chunks``).
LLAMA4 = dict(LLAMA, num_query_groups=2, no_rope_freq="[1, 0]", attention_chunk_size=16, qk_l2_norm=True,
              attn_temperature_tuning=True, num_experts=4, moe_router_topk=1, moe_router_score_function="sigmoid",
              moe_apply_probs_on_input=True, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
              moe_layer_freq="[0,1]")
ARCHITECTURES = {"gpt2": BASE, "llama_gqa": dict(LLAMA, num_query_groups=2),
                 "mla": dict(MLA, q_lora_rank=12), "mla_no_query_latent": MLA, "llama4": LLAMA4}


@pytest.fixture
def matmul_flops(monkeypatch):
    counted = []

    def counting(function, inner_width):
        def run(*args, **kwargs):
            output = function(*args, **kwargs)
            counted.append(2 * output.numel() * inner_width(*args))
            return output
        return run

    monkeypatch.setattr(F, "linear", counting(F.linear, lambda x, weight, *rest: weight.shape[1]))
    monkeypatch.setattr(torch, "bmm", counting(torch.bmm, lambda a, b: a.shape[-1]))
    monkeypatch.setattr(torch, "baddbmm", counting(torch.baddbmm, lambda c, a, b: a.shape[-1]))
    return counted


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_counted_flops_are_the_forward_passes_matmuls(name, matmul_flops):
    config = ModelConfig(**ARCHITECTURES[name])
    model = GPTModel(config, TensorParallelConfig()).eval()
    batch = 3
    with torch.no_grad():
        model(torch.randint(0, 100, (batch, config.seq_length)))
    forward = flops.num_floating_point_operations(config, batch, config.padded_vocab_size(1)) / 3
    assert sum(matmul_flops) == forward


@pytest.mark.parametrize("seq,chunk", [(16, 4), (16, 6)])
def test_chunked_layers_count_their_chunks(seq, chunk):
    """A chunked layer's attention counts as that of its chunks, each a sequence of its own (the last one
    shorter); the NoPE layer's counts the whole sequence."""
    def core(seq_length, **fields):
        return seq_length * flops.attention_core_flops_per_token(
            ModelConfig(**dict(LLAMA, seq_length=seq_length, **fields)), 0)

    chunked = dict(no_rope_freq="[0, 1]", attention_chunk_size=chunk)
    whole, rest = divmod(seq, chunk)
    assert core(seq, **chunked) == whole * core(chunk) + (core(rest) if rest else 0)
    nope = ModelConfig(**dict(LLAMA, seq_length=seq, **chunked))
    assert flops.attention_core_flops_per_token(nope, 1) == flops.attention_core_flops_per_token(nope, 0) * seq ** 2 / (
        whole * chunk ** 2 + rest ** 2)
