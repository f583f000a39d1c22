"""Mixtral against transformers' MixtralForCausalLM: import, logits, the router's auxiliary loss and its
gradient, greedy generation, export, and every expert accounted for.

A tiny random Mixtral (4 experts, top 2, sliding window 5, weights drawn wider than the init so each
expert computes something of its own) is imported at tensor x pipeline 2 x 2 and loaded back at
one process. Its load-balancing loss: transformers pools the router statistics of all layers,
Megatron-LM (and we) sum per-layer losses, each without transformers' factor top-k
(``hf_families``); so each layer's loss is compared with transformers' function on that layer's router
logits, and a one-layer model's whole training loss and gradients with transformers' own.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.checkpointing import hf_interop, read_config  # noqa: E402
from megatron_lite.checkpointing.offline import write_checkpoint  # noqa: E402
from megatron_lite.checkpointing.resharding import CheckpointReader  # noqa: E402
from megatron_lite.checkpointing.storage import resolve_checkpoint_dir  # noqa: E402
from megatron_lite.config import ConfigError  # noqa: E402
from megatron_lite.inference.text_generation import generate  # noqa: E402
from megatron_lite.process_groups.parallel_state import destroy_model_parallel  # noqa: E402
from tests.checkpointing.common import widen_and_save  # noqa: E402
from tests.checkpointing.hf_family_ranks import layouts_rank, load, sgd_step_gradients  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.inference.test_generation_vs_transformers import EOS, MAX_NEW_TOKENS, PAD, PROMPTS, _hf_generate  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB, EXPERTS, TOPK, COEF = 100, 4, 2, 0.02
ATOL = RTOL = 1e-5


def mixtral_config(layers: int = 2):
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=5,
        num_local_experts=EXPERTS, num_experts_per_tok=TOPK, output_router_logits=True, router_aux_loss_coef=COEF,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)


def _imported(directory, layers: int = 2):
    torch.manual_seed(0)
    hf_model = transformers.MixtralForCausalLM(mixtral_config(layers))
    widen_and_save(hf_model, directory / "hf")
    root = str(directory / "ckpt")
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", str(directory / "hf"),
                    "--save-dir", root, "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2" if layers > 1 else "1"]) == 0
    return hf_model, str(directory / "hf"), root


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _imported(tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(2, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def test_config_maps_every_feature(mixtral):
    config = read_config(mixtral[2]).model
    assert (config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (EXPERTS, TOPK, 48)
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert config.window_size == [4, 0] and config.moe_layer_freq == "1"
    assert config.moe_aux_loss_coeff == pytest.approx(COEF * TOPK / 2)  # see hf_families: k / L


def hf_generate(hf_model, prompts):
    """transformers' greedy tokens; its generate computes no router loss (transformers 5.24's fails to, on a
    left-padded batch: the attention mask is not cut to the new token)."""
    hf_model.config.output_router_logits = False
    try:
        return _hf_generate(hf_model, prompts, EOS)
    finally:
        hf_model.config.output_router_logits = True


def test_logits_and_greedy_generation_equal_transformers(mixtral, input_ids):
    hf_model, _, root = mixtral
    model, parallel_state = load(root)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids), hf_model(input_ids).logits, atol=ATOL, rtol=RTOL)
        batched = hf_generate(hf_model, PROMPTS)
        assert len({tuple(row) for row in batched}) == len(PROMPTS) and max(map(len, batched)) == MAX_NEW_TOKENS
        assert generate(model, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eod=EOS, greedy=True) == batched
        assert generate(model, PROMPTS[1:2], max_new_tokens=MAX_NEW_TOKENS, eod=EOS, greedy=True) == hf_generate(
            hf_model, PROMPTS[1:2])
    finally:
        destroy_model_parallel(parallel_state)


def test_expert_parallel_logits_and_generation_equal_transformers(mixtral, input_ids):
    """ep2 (with dp), ep2 x tp2 and ep2 x pp2, each in the same world of 4 ranks. Generation takes three prompts and
    then one: tensor-parallel ranks without sequence parallelism split a step's tokens unevenly, and one of them
    gets none."""
    hf_model, _, root = mixtral
    layouts = [(1, 1, 2), (2, 1, 2), (1, 2, 2)]
    generation = dict(max_new_tokens=MAX_NEW_TOKENS, eod=EOS)
    batches = [PROMPTS[:3], PROMPTS[3:]]
    per_rank = run_distributed(layouts_rank, 4, args=(root, input_ids, layouts, batches, generation))
    with torch.no_grad():
        expected = hf_model(input_ids).logits
    expected_tokens = [hf_generate(hf_model, prompts) for prompts in batches]
    for index, layout in enumerate(layouts):
        results = [rank_results[index] for rank_results in per_rank]
        assert sum(logits is not None for logits, _ in results) == (2 if layout[1] > 1 else 4), layout
        for logits, tokens in results:
            if logits is not None:
                torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL, msg=str(layout))
            assert tokens == expected_tokens, layout


def test_each_layers_load_balancing_loss_is_transformers(mixtral, input_ids):
    hf_model, _, root = mixtral
    model, parallel_state = load(root)
    try:
        model.train()
        model(input_ids).sum()  # a training forward: the routers compute their losses
        with torch.no_grad():
            router_logits = hf_model(input_ids, output_router_logits=True).router_logits
        for layer, logits in zip(model.decoder.layers.values(), router_logits):
            hf_loss = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
                (logits,), EXPERTS, TOPK)
            assert TOPK * layer.mlp.router.loss_sums["load_balancing_loss"].item() == pytest.approx(
                hf_loss.item(), rel=1e-6)
    finally:
        destroy_model_parallel(parallel_state)


def test_one_layer_training_loss_and_gradients_are_transformers(tmp_path, input_ids):
    """transformers' loss = cross entropy + router_aux_loss_coef x aux_loss; ours is the language-model loss with
    the router's loss attached, whose gradient must be the same in every weight."""
    hf_model, _, root = _imported(tmp_path, layers=1)
    hf_model.train()
    output = hf_model(input_ids, labels=input_ids)
    output.loss.backward()
    model, parallel_state = load(root)
    try:
        model.train()
        labels = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # the last position's label is unused
        lm_loss = model(input_ids, labels=labels)[:, :-1].mean()
        lm_loss.backward()
        router = model.decoder.layers["0"].mlp.router
        assert TOPK * router.loss_sums["load_balancing_loss"].item() == pytest.approx(output.aux_loss.item(), rel=1e-6)
        torch.testing.assert_close(lm_loss + router.aux_loss_coeff * router.loss_sums["load_balancing_loss"],
                                   output.loss.detach(), atol=1e-6, rtol=1e-6)
        ours = {name: p.grad for name, p in model.named_parameters()}
        theirs = dict(hf_model.named_parameters())
        torch.testing.assert_close(ours["decoder.layers.0.mlp.router.weight"],
                                   theirs["model.layers.0.mlp.gate.weight"].grad, atol=1e-6, rtol=1e-5)
        gate_up = theirs["model.layers.0.mlp.experts.gate_up_proj"].grad
        for e in range(EXPERTS):
            torch.testing.assert_close(ours[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"],
                                       gate_up[e], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours["embedding.word_embeddings.weight"][:VOCAB],
                                   theirs["model.embed_tokens.weight"].grad, atol=1e-6, rtol=1e-5)
    finally:
        destroy_model_parallel(parallel_state)


def test_router_loss_gradient_under_accumulation_and_data_parallelism_is_transformers(tmp_path):
    """Two micro-batches, accumulated at one process and split over two data-parallel ranks: the step's gradient
    is transformers' gradient of the mean of the two micro-batches' losses (cross entropy + coefficient x
    aux_loss), as its Trainer accumulates them."""
    hf_model, _, root = _imported(tmp_path, layers=1)
    hf_model.train()
    ids = torch.randint(2, VOCAB, (2, 2, 16), generator=torch.Generator().manual_seed(3))
    for micro_batch in ids:
        (hf_model(micro_batch, labels=micro_batch).loss / len(ids)).backward()
    theirs = dict(hf_model.named_parameters())
    # Ours predicts every position's next token: the last position, whose next token transformers does not
    # have, is masked out of the loss (the router still sees all 16 tokens, as transformers').
    loss_mask = torch.ones(2, 16)
    loss_mask[:, -1] = 0
    microbatches = [{"tokens": m, "labels": m.roll(-1, dims=1), "loss_mask": loss_mask,
                     "position_ids": torch.arange(16).expand(2, 16)} for m in ids]
    for world_size in (1, 2):
        args = (root, microbatches)
        ours = sgd_step_gradients(0, 1, *args) if world_size == 1 else run_distributed(sgd_step_gradients, 2, args)[0]
        expected = {"decoder.layers.0.mlp.router.weight": theirs["model.layers.0.mlp.gate.weight"].grad,
                    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight":
                        theirs["model.layers.0.mlp.experts.down_proj"].grad[3],
                    "decoder.layers.0.self_attention.linear_proj.weight":
                        theirs["model.layers.0.self_attn.o_proj.weight"].grad}
        for name, gradient in expected.items():
            torch.testing.assert_close(torch.from_numpy(ours[name]), gradient, atol=1e-6, rtol=1e-5,
                                       msg=f"{name} at {world_size} process(es)")


def _our_tensors(root: str) -> dict:
    reader = CheckpointReader(resolve_checkpoint_dir(root))
    return {name: reader.read(name) for name in reader.tensors}


def test_round_trip_is_bit_exact(mixtral, input_ids, tmp_path):
    hf_model, hf_dir, root = mixtral
    exported = str(tmp_path / "hf")
    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", root,
                    "--save-dir", exported]) == 0
    hf_config, original = hf_interop.read_hf_directory(hf_dir)
    exported_config, round_trip = hf_interop.read_hf_directory(exported)
    assert exported_config["model_type"] == "mixtral"
    assert exported_config["router_aux_loss_coef"] == pytest.approx(COEF) and exported_config["output_router_logits"]
    assert hf_interop.model_config_from_hf(exported_config) == hf_interop.model_config_from_hf(hf_config)
    assert original.keys() == round_trip.keys()
    assert sum(".experts." in key for key in original) == 2 * EXPERTS * 3
    for key in original:
        assert torch.equal(original[key], round_trip[key]), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, hf_model(input_ids).logits)


def test_an_expert_missing_or_extra_in_the_files_is_refused(mixtral):
    _, hf_dir, _ = mixtral
    hf_config, tensors = hf_interop.read_hf_directory(hf_dir)
    config = hf_interop.model_config_from_hf(hf_config)
    missing = {k: v for k, v in tensors.items() if ".experts.3." not in k}
    with pytest.raises(ConfigError, match=r"have no 'layers.0.block_sparse_moe.experts.3.w1.weight'"):
        hf_interop.weights_from_hf(missing, config, "mixtral")
    extra = dict(tensors, **{k.replace(".experts.3.", ".experts.4."): v for k, v in tensors.items()
                             if ".experts.3." in k})
    with pytest.raises(ConfigError, match=r"not understood .*experts\.4\."):
        hf_interop.weights_from_hf(extra, config, "mixtral")


def test_a_duplicated_expert_changes_the_logits(mixtral, input_ids, tmp_path):
    """What makes the logits test catch a converter that writes one expert's weights for another: here
    expert 2 of layer 0 is replaced by expert 1, as such a converter would, and the logits move."""
    hf_model, _, root = mixtral
    tensors = _our_tensors(root)
    for projection in ("linear_fc1", "linear_fc2"):
        name = "decoder.layers.0.mlp.experts.local_experts.{}." + projection + ".weight"
        tensors[name.format(2)] = tensors[name.format(1)]
    config = read_config(root)
    write_checkpoint(str(tmp_path / "dup"), config, tensors.__getitem__, iteration=0)
    model, parallel_state = load(str(tmp_path / "dup"))
    try:
        with torch.no_grad():
            assert (model(input_ids) - hf_model(input_ids).logits).abs().max() > 100 * ATOL
    finally:
        destroy_model_parallel(parallel_state)
