"""Multi-token prediction (--mtp-num-layers) against its formula, written out here from Megatron-LM's
(DeepSeek-V3's) definition rather than through ``multi_token_prediction.py``:

    h^0 = the decoder's output after its final norm
    h^k = RMSNorm_final_k(Layer_k([RMSNorm_e_k(E[t_{i+k}]); RMSNorm_h_k(h^{k-1}_i)] W_eh_k^T))
    L_k = sum_i m^k_i CE(h^k_i W_out^T, label_{i+k}) / sum_i m^k_i,  m^k_i = m_{i+k} [i+k in i's document]
    loss = lm loss + λ / D sum_k L_k

with the decoder and each depth's transformer layer the only modules of ours used as they are (tested on their
own elsewhere). A tiny model with weights drawn wide (std 0.3), two depths, one of the two sequences packing
two documents (positions restarting, a block-diagonal mask) and loss-mask zeros inside both: the L_k logged, the
returned (language-model) loss, and the gradient of every weight.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import (CheckpointConfig, Config, ConfigError, DataConfig, ModelConfig, ParallelConfig,
                                  TrainingConfig)
from megatron_lite.model.builder import build_model
from megatron_lite.model.embedding import rotary_angles
from megatron_lite.process_groups.parallel_state import mock_parallel_state

VOCAB, LENGTH, EPS = 40, 8, 1e-5
MODEL = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, seq_length=LENGTH,
             vocab_size=VOCAB, make_vocab_size_divisible_by=8, normalization="RMSNorm", norm_epsilon=EPS,
             position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3,
             mtp_num_layers=2, mtp_loss_scaling_factor=0.3)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _batch():
    """Two sequences: the first two documents of 5 and 3 tokens (positions restart), the second one document."""
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(4))
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0] * LENGTH])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], list(range(LENGTH))])
    loss_mask = torch.ones(2, LENGTH)
    loss_mask[0, 2] = loss_mask[1, 5] = loss_mask[:, -1] = 0
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    may_attend = causal & (documents[:, :, None] == documents[:, None, :])
    return tokens, labels, positions, loss_mask, documents, ~may_attend[:, None]


def _shifted(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """tensor[:, i + k], zero past the end."""
    return torch.cat([tensor[:, k:], tensor.new_zeros(tensor.shape[0], k)], dim=1)


def _formula(model, tokens, labels, positions, loss_mask, documents, attention_mask):
    """(lm loss, [L_1, L_2], total) from the definition above."""
    rotary = rotary_angles(positions, model.config)
    embedding, output = model.embedding.word_embeddings.weight, model.output_layer.weight
    hidden = model.final_layernorm(model.decoder(model.embedding(tokens, positions), rotary, attention_mask))

    def cross_entropy(states, targets):  # states [s, b, h] -> per-token [b, s]
        logits = (states @ output.t())[..., :VOCAB].transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none").view(targets.shape)

    lm_loss = (cross_entropy(hidden, labels) * loss_mask).sum() / loss_mask.sum()
    depth_losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        next_embeddings = embedding[_shifted(tokens, k)].transpose(0, 1)
        combined = torch.cat([_rms(next_embeddings, layer.enorm.weight), _rms(hidden, layer.hnorm.weight)], dim=-1)
        inner = layer.mtp_model_layer(combined @ layer.eh_proj.weight.t(), rotary.global_angles, attention_mask,
                                      positions)
        hidden = _rms(inner, layer.final_layernorm.weight)
        mask = _shifted(loss_mask, k) * (_shifted(documents, k) == documents)
        depth_losses.append((cross_entropy(hidden, _shifted(labels, k)) * mask).sum() / mask.sum())
    total = lm_loss + model.config.mtp_loss_scaling_factor / len(depth_losses) * sum(depth_losses)
    return lm_loss, depth_losses, total


def test_mtp_loss_and_gradients_equal_the_formula():
    (model,) = build_model(Config(model=ModelConfig(**MODEL)), mock_parallel_state(0, 1))
    model.train()
    tokens, labels, positions, loss_mask, documents, attention_mask = _batch()
    per_token = model(tokens, positions, attention_mask, labels=labels, loss_mask=loss_mask)
    ((per_token * loss_mask).sum() / loss_mask.sum()).backward()  # what the schedule backpropagates
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    logged = [loss.item() for loss in model.mtp.logged_losses]
    model.zero_grad()
    lm_loss, depth_losses, total = _formula(model, tokens, labels, positions, loss_mask, documents, attention_mask)
    total.backward()
    # The returned loss is the language model's alone: MTP's joins only its gradient.
    assert ((per_token * loss_mask).sum() / loss_mask.sum()).item() == pytest.approx(lm_loss.item(), rel=1e-6)
    assert logged == pytest.approx([loss.item() for loss in depth_losses], rel=1e-6)
    assert len(set(round(v, 3) for v in logged + [lm_loss.item()])) == 3  # three different losses
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(ours[name], parameter.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ours["mtp.layers.1.eh_proj.weight"].abs().max() > 1e-3  # the deepest depth trains
    # Without MTP's gradient the decoder's weights would move otherwise: the comparison sees it.
    model.zero_grad()
    _formula(model, tokens, labels, positions, loss_mask, documents, attention_mask)[0].backward()
    moved = model.decoder.layers["1"].self_attention.linear_qkv.weight
    assert (ours["decoder.layers.1.self_attention.linear_qkv.weight"] - moved.grad).abs().max() > 1e-4


def test_generation_and_evaluation_run_the_decoder_alone():
    (model,) = build_model(Config(model=ModelConfig(**MODEL)), mock_parallel_state(0, 1))
    tokens, labels, positions, loss_mask, _, attention_mask = _batch()
    model.eval()
    evaluated = model(tokens, positions, attention_mask, labels=labels, loss_mask=loss_mask)
    assert model.mtp.logged_losses == []
    model.mtp = None
    assert torch.equal(evaluated, model(tokens, positions, attention_mask, labels=labels))


def test_mtp_layers_take_the_decoder_last_layer_kind():
    """DeepSeek-V3's first layers are dense and its MTP layer has experts: Megatron-LM builds the MTP layer from
    the decoder's last layer spec."""
    config = ModelConfig(**{**MODEL, "num_experts": 4, "moe_layer_freq": "[0,1]", "moe_router_topk": 2})
    (model,) = build_model(Config(model=config), mock_parallel_state(0, 1))
    assert not hasattr(model.decoder.layers["0"].mlp, "router")
    assert all(hasattr(layer.mtp_model_layer.mlp, "router") for layer in model.mtp.layers)
    assert [layer.mtp_model_layer.layer_number for layer in model.mtp.layers] == [2, 3]


@pytest.mark.parametrize("changes, message", [
    (dict(mtp_num_layers=0), "--mtp-num-layers must be at least 1"),
    (dict(mtp_loss_scaling_factor=-1.0), "--mtp-loss-scaling-factor must be >= 0"),
    (dict(num_experts=4, moe_router_load_balancing_type="pooled_aux_loss", moe_aux_loss_coeff=0.01),
     "pooled_aux_loss pools the routing of the decoder's layers"),
])
def test_model_flags_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**MODEL, **changes})


def test_context_parallelism_and_dpo_refused_by_name():
    with pytest.raises(ConfigError, match="--mtp-num-layers with --context-parallel-size > 1"):
        Config(model=ModelConfig(**MODEL), parallel=ParallelConfig(context_parallel_size=2))
    with pytest.raises(ConfigError, match="--mtp-num-layers with --dpo"):
        Config(model=ModelConfig(**MODEL), data=DataConfig(dpo=True, train_data_path=["x.jsonl"],
                                                           tokenizer_type="NullTokenizer"),
               checkpoint=CheckpointConfig(pretrained_checkpoint="base"), training=TrainingConfig(micro_batch_size=2))
