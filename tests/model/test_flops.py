"""The FLOPs the log's throughput and the planner charge (``model/flops.py``) equal the matmuls a forward pass
of the real model runs: GPT-2, Llama with grouped-query attention, and multi-latent attention with and without
a query latent. Every linear layer goes through ``F.linear`` and the explicit attention path through
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
ARCHITECTURES = {"gpt2": BASE, "llama_gqa": dict(LLAMA, num_query_groups=2),
                 "mla": dict(MLA, q_lora_rank=12), "mla_no_query_latent": MLA}


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
