"""The FLOPs the log's throughput and the planner charge (``model/flops.py``) equal the matmuls a forward pass
of the real model runs, counted by torch's FlopCounterMode: GPT-2, Llama with grouped-query attention, and
multi-latent attention with and without a query latent. The explicit attention path is counted (torch's
counter skips the CPU flash kernel), so the core attention is there in full, as the formula counts it."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

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


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_counted_flops_are_the_forward_passes_matmuls(name):
    config = ModelConfig(**ARCHITECTURES[name])
    model = GPTModel(config, TensorParallelConfig()).eval()
    batch = 3
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 100, (batch, config.seq_length)))
    forward = flops.num_floating_point_operations(config, batch, config.padded_vocab_size(1)) / 3
    assert counter.get_total_flops() == forward
