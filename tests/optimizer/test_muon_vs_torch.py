"""Muon and Lion at one process, through the training loop, against independent references.

An imported Hugging Face Llama fine-tunes 4 steps with --optimizer muon; the same model in transformers steps with
torch.optim.Muon on its separate q, k, v, o, gate, up and down matrices and torch AdamW on the rest (embeddings,
output layer, norms), clipped by torch's clip_grad_norm_. Our fused QKV and [gate; up] weights must be split
per matrix to agree (--muon-no-split-qkv visibly does not). Lion, which torch lacks, is checked against the
paper's update written out by hand.

torch.optim.Muon iterates Newton-Schulz in bf16, whose rounding (3% of the update here) would swamp the
comparison: the reference runs with its bf16 copy made an fp32 one (its code otherwise untouched), ours with
--muon-fp32-matmul-prec high.
"""
import dataclasses
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.checkpointing import read_config
from megatron_lite.interop.hf.weights import weights_to_hf
from megatron_lite.config import CheckpointConfig, DataConfig, LoggingConfig, OptimizerConfig, TrainingConfig
from megatron_lite.training import loop
from tests.parity import assert_relative_close
from tests.sft.test_sft_training import EOD, PAIRS, VOCAB, _write_jsonl

transformers = pytest.importorskip("transformers")

from tools.checkpoint_convert import main as convert  # noqa: E402

STEPS = 4
LR, WEIGHT_DECAY, CLIP = 2e-3, 0.1, 0.5
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # std 0.2: gradients well above --clip-grad, so clipping acts every step
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    hf_dir, ckpt = str(tmp_path_factory.mktemp("hf")), str(tmp_path_factory.mktemp("ckpt"))
    model.save_pretrained(hf_dir)
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", hf_dir,
                    "--save-dir", ckpt]) == 0
    return hf_dir, ckpt


def _ours(ckpt, data, **optimizer):
    saved = read_config(ckpt)
    config = dataclasses.replace(
        saved, model=dataclasses.replace(saved.model, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0),
        # Every iteration is the 4 examples, whatever their order: the loss is their mean over response tokens.
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=STEPS),
        optimizer=OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP, lr_decay_style="constant",
                                  muon_fp32_matmul_prec="high", **optimizer),
        data=DataConfig(sft=True, train_data_path=[data], tokenizer_type="NullTokenizer"),
        checkpoint=CheckpointConfig(load=ckpt, finetune=True), logging=LoggingConfig(log_memory=False))
    state, chunks, _ = loop.pretrain(config)
    weights = {k: v.detach() for k, v in chunks[0].module.state_dict().items()}
    return state.losses, weights_to_hf(weights.__getitem__, config.model)


def _loss(model):
    total, count = 0.0, 0
    for prompt, response in PAIRS:
        ids = prompt + response + [EOD]
        logits = model(torch.tensor([ids])).logits[0]
        total = total + F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")[len(prompt) - 1:].sum()
        count += len(response) + 1
    return total / count


def _reference(hf_dir, make_optimizers):
    with mock.patch.object(torch.Tensor, "bfloat16", lambda tensor: tensor.clone()):
        return _reference_steps(hf_dir, make_optimizers)


def _reference_steps(hf_dir, make_optimizers):
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    optimizers = make_optimizers(dict(model.named_parameters()))
    losses = []
    for _ in range(STEPS):
        model.zero_grad()
        loss = _loss(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for optimizer in optimizers:
            optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _muon_and_adamw(adjust_lr_fn, momentum=0.9, nesterov=False):
    def make(params):
        matrices = [p for n, p in params.items() if n.split(".")[-2] in MATRICES]
        decayed = [p for n, p in params.items() if p.ndim == 2 and n.split(".")[-2] not in MATRICES]
        norms = [p for p in params.values() if p.ndim == 1]
        return [torch.optim.Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY, momentum=momentum, nesterov=nesterov,
                                 adjust_lr_fn=adjust_lr_fn),
                torch.optim.AdamW([{"params": decayed}, {"params": norms, "weight_decay": 0.0}], lr=LR,
                                  weight_decay=WEIGHT_DECAY)]
    return make


def _compare(ours, reference, rel=1e-4):
    (losses, weights), (ref_losses, ref_weights) = ours, reference
    assert_relative_close(losses, ref_losses, rel=rel, what="losses")
    for name, expected in ref_weights.items():
        assert_relative_close(weights[name], expected, rel=rel, what=name)


# torch.optim.Muon's adjust_lr_fn is our scale mode: "original" is shape_scaling, "match_rms_adamw" is spectral
# times 0.2. Its one coefficient triple is --muon-coefficient-type simple; it iterates in bf16 (medium precision).
@pytest.mark.parametrize("adjust_lr_fn, flags", [
    ("original", dict(muon_scale_mode="shape_scaling")),
    ("match_rms_adamw", dict(muon_scale_mode="spectral", muon_extra_scale_factor=0.2, muon_nesterov=True,
                             muon_momentum=0.95))])
def test_muon_equals_torch_muon_with_adamw_on_the_rest(imported, tmp_path, adjust_lr_fn, flags):
    hf_dir, ckpt = imported
    ours = _ours(ckpt, _write_jsonl(tmp_path / "sft.jsonl"), optimizer="muon", muon_coefficient_type="simple",
                 **flags)
    reference = _reference(hf_dir, _muon_and_adamw(adjust_lr_fn, momentum=flags.get("muon_momentum", 0.9),
                                                   nesterov=flags.get("muon_nesterov", False)))
    _compare(ours, reference)
    # The loss moved: the comparison is of real updates.
    assert reference[0][-1] < reference[0][0] - 0.01


def test_unsplit_qkv_is_not_torch_muon_on_separate_matrices(imported, tmp_path):
    hf_dir, ckpt = imported
    _, weights = _ours(ckpt, _write_jsonl(tmp_path / "sft.jsonl"), optimizer="muon", muon_coefficient_type="simple",
                       muon_scale_mode="shape_scaling", muon_split_qkv=False)
    _, expected = _reference(hf_dir, _muon_and_adamw("original"))
    name = "model.layers.0.self_attn.k_proj.weight"
    # Measured 4e-3 of the scale: 40 times the tolerance the split weights meet.
    assert (weights[name] - expected[name]).abs().max() > 1e-3 * expected[name].abs().max()


def _lion_by_hand(params, beta1=0.95, beta2=0.98):
    """Chen et al. 2023, Algorithm 2 (decoupled weight decay), written out."""
    class HandLion:
        def __init__(self):
            self.momentum = {name: torch.zeros_like(p) for name, p in params.items()}

        @torch.no_grad()
        def step(self):
            for name, p in params.items():
                m, g = self.momentum[name], p.grad
                update = torch.sign(beta1 * m + (1 - beta1) * g)
                decay = 0.0 if p.ndim == 1 else WEIGHT_DECAY
                p -= LR * (update + decay * p)
                self.momentum[name] = beta2 * m + (1 - beta2) * g
    return [HandLion()]


def test_lion_equals_the_papers_update(imported, tmp_path):
    hf_dir, ckpt = imported
    ours = _ours(ckpt, _write_jsonl(tmp_path / "sft.jsonl"), optimizer="lion")
    _compare(ours, _reference(hf_dir, _lion_by_hand))


def test_muon_with_lion_on_the_rest(imported, tmp_path):
    hf_dir, ckpt = imported
    ours = _ours(ckpt, _write_jsonl(tmp_path / "sft.jsonl"), optimizer="muon", muon_coefficient_type="simple",
                 muon_scale_mode="shape_scaling", muon_scalar_optimizer="lion")

    def make(params):
        matrices = {n: p for n, p in params.items() if n.split(".")[-2] in MATRICES}
        rest = {n: p for n, p in params.items() if n not in matrices}
        return [torch.optim.Muon(list(matrices.values()), lr=LR, weight_decay=WEIGHT_DECAY, momentum=0.9,
                                 nesterov=False, adjust_lr_fn="original"), *_lion_by_hand(rest)]
    _compare(ours, _reference(hf_dir, make))
