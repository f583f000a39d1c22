"""Mixture-of-experts layers at one process: the router against its formulas written out here, the grouped
GEMM against the loop, the layer against a token-by-token reference, the losses' gradients, the layer
pattern, and the flags' checks (docs/reference.md section 14)."""
import math

import pytest
import torch

from megatron_lite.config import Config, ConfigError, ModelConfig
from megatron_lite.cli.arguments import parse_args
from megatron_lite.config.moe import parse_moe_layer_freq
from megatron_lite.model.mlp import MLP
from megatron_lite.model.moe import MoELayer
from megatron_lite.model.moe.aux_losses import attach_loss
from megatron_lite.model.moe.experts import GroupedExperts, SequentialExperts
from megatron_lite.model.moe.router import TokenLayout, TopKRouter
from megatron_lite.model.moe.routing_statistics import update_expert_bias
from megatron_lite.expert_parallel import ExpertParallelConfig
from megatron_lite.process_groups.parallel_state import mock_parallel_state
from megatron_lite.tensor_parallel import TensorParallelConfig

E, K, H = 8, 2, 32


def moe_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=16, vocab_size=256, num_experts=E,
                  moe_router_topk=K, swiglu=True, ffn_hidden_size=48, moe_ffn_hidden_size=16, add_bias_linear=False,
                  normalization="RMSNorm", position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**fields, **overrides})


def router(**overrides) -> TopKRouter:
    torch.manual_seed(0)
    r = TopKRouter(moe_config(**overrides), tensor_parallel_size=1, params_dtype=torch.float32)
    torch.nn.init.normal_(r.weight, std=0.5)
    return r


def layout(tokens: int, sequences: int = 1) -> TokenLayout:
    return TokenLayout(torch.arange(tokens) % sequences, sequences, tokens // sequences)


def _chosen(probs):
    return [set(torch.nonzero(row).flatten().tolist()) for row in probs]


@pytest.mark.parametrize("variant", ["softmax", "pre_softmax", "sigmoid", "sigmoid_bias", "scaled", "grouped",
                                     "grouped_max"])
def test_router_weights_and_choices_follow_megatrons_formulas(variant):
    options = {"softmax": {}, "pre_softmax": dict(moe_router_pre_softmax=True),
               "sigmoid": dict(moe_router_score_function="sigmoid"),
               "sigmoid_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
               "scaled": dict(moe_router_topk_scaling_factor=2.5),
               "grouped": dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4),
               # DeepSeek-V2's group_limited_greedy: pre-softmax scores, each group scored by its best one.
               "grouped_max": dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=3,
                                   moe_router_group_score="max", moe_router_pre_softmax=True)}[variant]
    r = router(**options).eval()
    if variant == "sigmoid_bias":
        r.expert_bias.copy_(torch.linspace(-1, 1, E))
    x = torch.randn(24, H)
    probs, routing_map = r(x, layout(24))
    logits = x @ r.weight.t()
    topk = r.topk
    for token in range(24):
        row = logits[token]
        if variant == "grouped":  # groups of 2 experts; a group's score is its best topk/group_topk = 2 summed
            groups = row.view(4, 2).topk(2, dim=-1).values.sum(-1).topk(2).indices.tolist()
            allowed = torch.tensor([e // 2 in groups for e in range(E)])
            chosen = row.masked_fill(~allowed, -math.inf).topk(topk).indices
            weights = torch.softmax(row[chosen], 0)
        elif variant == "grouped_max":  # groups of 4 experts, the group of the best score, its top 3
            scores = torch.softmax(row, 0)
            allowed = torch.arange(E) // 4 == scores.argmax() // 4
            chosen = scores.masked_fill(~allowed, 0.0).topk(topk).indices
            weights = scores[chosen]
        elif variant.startswith("sigmoid"):
            score = torch.sigmoid(row)
            bias = r.expert_bias if variant == "sigmoid_bias" else 0
            chosen = (score + bias).topk(topk).indices
            weights = score[chosen] / score[chosen].sum()
        elif variant == "pre_softmax":
            chosen = torch.softmax(row, 0).topk(topk).indices
            weights = torch.softmax(row, 0)[chosen]
        else:
            chosen = row.topk(topk).indices
            weights = torch.softmax(row[chosen], 0) * (2.5 if variant == "scaled" else 1.0)
        assert _chosen(probs[token:token + 1])[0] == set(chosen.tolist())
        assert routing_map[token].nonzero().flatten().tolist() == sorted(chosen.tolist())
        torch.testing.assert_close(probs[token, chosen], weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_keeps_the_most_probable_or_earliest_tokens(policy, pad):
    r = router(moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy,
               moe_pad_expert_input_to_capacity=pad).eval()
    free = router().eval()
    x = torch.randn(16, H) + 3 * torch.randn(H)  # one direction dominant: some experts are crowded
    probs, kept = r(x, layout(16))
    dropless, routed = free(x, layout(16))
    capacity = math.ceil(16 * K / E * 1.0)
    per_expert = kept.sum(dim=0)
    assert (per_expert == capacity).all() if pad else (per_expert <= capacity).all()
    for e in range(E):
        wanted = routed[:, e].nonzero().flatten()
        if len(wanted) <= capacity:
            expected = set(wanted.tolist())
        elif policy == "probs":
            expected = set(wanted[dropless[wanted, e].topk(capacity).indices].tolist())
        else:
            expected = set(wanted[:capacity].tolist())
        assert expected <= set(kept[:, e].nonzero().flatten().tolist())
        if not pad:
            assert set(kept[:, e].nonzero().flatten().tolist()) == expected
    torch.testing.assert_close(probs, dropless * kept)  # kept tokens keep their weights, padding weighs 0


def _scores(logits, function):
    if function == "softmax":
        return torch.softmax(logits, -1)
    s = torch.sigmoid(logits)
    return s / s.sum(-1, keepdim=True)


@pytest.mark.parametrize("kind,function", [("aux_loss", "softmax"), ("seq_aux_loss", "softmax"),
                                           ("aux_loss", "sigmoid")])
def test_balancing_and_z_losses_equal_their_formulas_and_reach_the_router_weight(kind, function):
    r = router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
               moe_router_score_function=function).train()
    sequences, length = 3, 8
    x = torch.randn(sequences * length, H)
    probs, routing_map = r(x, layout(sequences * length, sequences))
    g = torch.randn_like(probs)
    (probs * g).sum().backward()
    logits = (x @ r.weight.t()).detach().requires_grad_()
    scores = _scores(logits, function)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(K).indices, 1.0)
    if kind == "aux_loss":
        T = sequences * length
        balance = E / (K * T * T) * (scores.sum(0) * counts.sum(0)).sum()
    else:  # tokens are rows position * sequences + sequence
        balance = sum(E / (K * length ** 2) * (scores[s::sequences].sum(0) * counts[s::sequences].sum(0)).sum()
                      for s in range(sequences)) / sequences
    z = torch.logsumexp(logits, -1).square().mean()
    logged = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[kind]
    torch.testing.assert_close(r.loss_sums[logged], balance.detach())
    torch.testing.assert_close(r.loss_sums["z_loss"], z.detach())
    # The router weight's gradient: the probabilities' own plus the two losses with their coefficients.
    reference = router(moe_router_load_balancing_type=kind, moe_router_score_function=function).eval()
    reference.weight.data.copy_(r.weight.data)
    probs_only, _ = reference(x, layout(sequences * length, sequences))
    total = (probs_only * g).sum() + 0.1 * _balance_of(reference, x, kind, function, sequences, length) + \
        0.01 * torch.logsumexp(x @ reference.weight.t(), -1).square().mean()
    total.backward()
    torch.testing.assert_close(r.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-7)


def _balance_of(r, x, kind, function, sequences, length):
    scores = _scores(x @ r.weight.t(), function)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(K).indices, 1.0)
    if kind == "aux_loss":
        return E / (K * (sequences * length) ** 2) * (scores.sum(0) * counts.sum(0)).sum()
    return sum(E / (K * length ** 2) * (scores[s::sequences].sum(0) * counts[s::sequences].sum(0)).sum()
               for s in range(sequences)) / sequences


def test_attached_loss_gets_the_iterations_gradient_scale():
    x = torch.randn(4, requires_grad=True)
    w = torch.ones(1, requires_grad=True)
    out = attach_loss(x * 2, (w * 3).sum(), scale=0.25)
    out.sum().backward()
    assert w.grad.item() == pytest.approx(0.75) and torch.equal(x.grad, torch.full((4,), 2.0))


def _experts(kind, etp_size=1, **overrides):
    config = moe_config(moe_ffn_hidden_size=16, **overrides)
    torch.manual_seed(1)
    experts = kind(config, first_expert=4, num_local_experts=3, etp_size=etp_size, params_dtype=torch.float32)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return experts


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("overrides", [{}, dict(add_bias_linear=True, quick_geglu=True, glu_linear_offset=1.0,
                                                activation_func_clamp_value=0.5)])  # gpt-oss's experts
def test_grouped_gemm_equals_the_loop_forward_and_backward(overrides):
    loop, grouped = _experts(SequentialExperts, **overrides), _experts(GroupedExperts, **overrides)
    grouped.load_state_dict(loop.state_dict())
    assert list(loop.local_experts) == ["4", "5", "6"]  # experts keep their global numbers
    rows = torch.randn(9, H)
    counts = [5, 0, 4]  # an expert that received no token
    outputs = [m(rows, counts) for m in (loop, grouped)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    g = torch.randn_like(outputs[0])
    for out in outputs:
        (out * g).sum().backward()
    for (name, a), b in zip(loop.named_parameters(), grouped.parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def _moe_layer(**overrides):
    config = moe_config(**overrides)
    torch.manual_seed(2)
    layer = MoELayer(config, tp_config=TensorParallelConfig(), ep_config=ExpertParallelConfig())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


@pytest.mark.parametrize("overrides", [{}, dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True),
                                       dict(moe_grouped_gemm=True, moe_router_score_function="sigmoid")])
def test_moe_layer_equals_each_token_summing_its_experts(overrides):
    layer = _moe_layer(**overrides).eval()
    x = torch.randn(6, 2, H)
    output, bias = layer(x)
    assert bias is None and output.shape == x.shape
    experts = layer.experts.local_experts
    for s in range(6):
        for b in range(2):
            token = x[s, b]
            probs, _ = layer.router(token[None], layout(1))
            expected = sum(probs[0, e] * experts[str(e)](token[None])[0] for e in probs[0].nonzero().flatten().tolist())
            if layer.shared_experts is not None:
                shared, _ = layer.shared_experts(token[None, None])
                expected = expected + shared[0, 0]
            torch.testing.assert_close(output[s, b], expected, rtol=1e-5, atol=1e-5)


def test_expert_bias_moves_by_the_rate_towards_equal_counts():
    config = Config(model=moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                     moe_router_bias_update_rate=0.125))
    from megatron_lite.model.builder import build_model_chunk
    model = build_model_chunk(config, mock_parallel_state(0, 1), pipeline_rank=0)
    counts = [torch.tensor([3., 1, 2, 2, 0, 4, 2, 2]), torch.tensor([2.] * 8)]
    for layer, count in zip(model.decoder.layers.values(), counts):
        layer.mlp.router.tokens_per_expert.copy_(count)
        layer.mlp.router.expert_bias.fill_(0.5)
    update_expert_bias([model], mock_parallel_state(0, 1))
    # bias += rate * sign(mean - count): the mean is 2 in both layers.
    assert model.decoder.layers["0"].mlp.router.expert_bias.tolist() == [
        0.375, 0.625, 0.5, 0.5, 0.625, 0.375, 0.5, 0.5]
    assert model.decoder.layers["1"].mlp.router.expert_bias.tolist() == [0.5] * 8


def test_moe_layer_freq_patterns_and_first_dense_layers():
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("([0]+[1]*3)") == [0, 1, 1, 1]
    assert parse_moe_layer_freq("([1]*2+[0]*1)*2") == [1, 1, 0, 1, 1, 0]
    config = moe_config(num_layers=4, moe_layer_freq="([0]+[1]*3)")
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert [moe_config(num_layers=4, moe_layer_freq=2).is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    from megatron_lite.model.transformer_layer import TransformerLayer
    layers = [TransformerLayer(config, layer_number=i, tp_config=TensorParallelConfig()) for i in range(2)]
    assert type(layers[0].mlp) is MLP and type(layers[1].mlp) is MoELayer


@pytest.mark.parametrize("text", ["__import__('os')", "[2]*3", "[0,1]*[2]", "([1]*10**9)", "open"])
def test_moe_layer_freq_is_parsed_never_evaluated(text):
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_moe_layer_freq(text) if text != "[2]*3" else moe_config(moe_layer_freq=text)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "256", "--mock-data", "--disable-bias-linear"]


@pytest.mark.parametrize("extra, match", [
    (["--moe-router-topk", "2"], None),
    (["--moe-grouped-gemm"], "add --num-experts N"),
    (["--expert-model-parallel-size", "2"], "add --num-experts N"),
    (["--num-experts", "4", "--moe-router-topk", "5"], r"--moe-router-topk \(5\) must be between 1"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], r"--num-experts \(6\) must be divisible"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], "gives 3 layers, but --num-layers is 2"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"], "add --moe-router-score-function sigmoid"),
    (["--num-experts", "4", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "must divide"),
    (["--num-experts", "4", "--moe-router-group-score", "max"], "add --moe-router-num-groups"),
    (["--num-experts", "4", "--moe-shared-expert-gate"], "add --moe-shared-expert-intermediate-size"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "add --moe-expert-capacity-factor"),
    (["--num-experts", "4", "--moe-router-score-function", "sqrtsoftplus"], "invalid choice"),
    (["--num-experts", "4", "--peft", "lora", "--peft-without-base-checkpoint", "--moe-grouped-gemm"],
     "--moe-grouped-gemm bypasses"),
    (["--num-experts", "4", "--peft", "lora", "--peft-without-base-checkpoint", "--tensor-model-parallel-size", "4",
      "--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 1 or the tensor-parallel size"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], "dispatches tokens with all-to-all only"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "pooled_aux_loss", "--recompute-granularity", "full"],
     "pooled_aux_loss pools each micro-batch's routing over all layers"),
    (["--qk-layernorm-whole-projection"], "takes --qk-layernorm and --normalization RMSNorm"),
])
def test_moe_flags_are_checked_naming_the_flag(extra, match):
    if match is None:  # routing flags alone mean nothing: the defaults are Megatron-LM's and harmless
        parse_args(BASE + extra)
        return
    with pytest.raises(ConfigError, match=match):
        parse_args(BASE + extra)


def test_expert_biases_split_only_as_the_tensor_parallel_layers():
    """gpt-oss's biased experts (--add-bias-linear): whole on every rank or split over the tensor-parallel ranks."""
    parse_args(BASE[:-1] + ["--num-experts", "4", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size must be 1 or --tensor-model-parallel-size"):
        parse_args(BASE[:-1] + ["--num-experts", "4", "--tensor-model-parallel-size", "4",
                                "--expert-tensor-parallel-size", "2"])


def test_log_line_shows_the_routers_losses_and_expert_load(capsys):
    from megatron_lite.config import DataConfig, LoggingConfig, TrainingConfig
    from megatron_lite.model.moe.routing_statistics import routers
    from megatron_lite.training.loop import pretrain
    config = Config(model=moe_config(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=2),
                    data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=1, log_memory=False))
    _, chunks, _ = pretrain(config)
    last = [line for line in capsys.readouterr().out.splitlines() if " iteration        2/" in line][0]
    fields = dict(part.strip().rsplit(": ", 1) for part in last.split("|") if ": " in part)
    found = routers(chunks)  # the last iteration's statistics, 2 micro-batches
    assert float(fields["load_balancing_loss"]) == pytest.approx(
        sum(r.loss_sums["load_balancing_loss"].item() / r.microbatches for r in found.values()) / len(found), rel=1e-6)
    assert float(fields["z_loss"]) == pytest.approx(
        sum(r.loss_sums["z_loss"].item() / r.microbatches for r in found.values()) / len(found), rel=1e-6)
    counts = torch.stack([r.tokens_per_expert for r in found.values()])
    assert counts.sum().item() == 2 * 4 * 16 * K  # layers x sequences x tokens x top-k
    assert float(fields["expert load max/min"]) == pytest.approx((counts.max(1).values / counts.min(1).values).max()
                                                                  .item(), abs=0.006)
    assert list(fields).index("load_balancing_loss") == list(fields).index("lm loss") + 1  # Megatron-LM's place


def test_router_losses_follow_the_language_model_losss_scaling():
    """Every token counts here, so --calculate-per-token-loss trains exactly as the per-micro-batch mean: its
    router losses, multiplied by each micro-batch's tokens before the global division, too. A static loss scale
    (fp32 here, where it changes nothing) must reach the router losses' gradient as the loss's, and come off
    with it."""
    from megatron_lite.config import DataConfig, LoggingConfig, OptimizerConfig, TrainingConfig
    from megatron_lite.training.loop import pretrain
    runs = []
    for per_token, loss_scale in ((False, None), (True, None), (False, 1024.0)):
        config = Config(model=moe_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1),
                        training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=2,
                                                calculate_per_token_loss=per_token),
                        optimizer=OptimizerConfig(loss_scale=loss_scale),
                        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=10, log_memory=False))
        state, chunks, _ = pretrain(config)
        runs.append((state.losses, {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}))
    (mean_losses, mean_weights), *variants = runs
    for losses, weights in variants:
        assert losses == pytest.approx(mean_losses, rel=1e-6)
        for name, weight in mean_weights.items():
            torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-7, msg=name)


def test_a_bf16_router_routes_in_fp32():
    config = moe_config()
    half = TopKRouter(config, tensor_parallel_size=1, params_dtype=torch.bfloat16).eval()
    full = TopKRouter(config, tensor_parallel_size=1, params_dtype=torch.float32).eval()
    torch.nn.init.normal_(half.weight, std=0.5)
    full.weight.data.copy_(half.weight.float())
    x = torch.randn(16, H).bfloat16()
    probs, routing_map = half(x, layout(16))
    expected_probs, expected_map = full(x.float(), layout(16))
    assert probs.dtype == torch.float32
    assert torch.equal(routing_map, expected_map) and torch.equal(probs, expected_probs)
