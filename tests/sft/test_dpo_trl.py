"""--dpo equals TRL's DPOTrainer: the same tiny Llama, pairs and hyper-parameters give the same loss, rewards,
reward accuracy, margin and gradient norm at every iteration (fp32), the first loss being ln 2.

The pairs are space-separated ids, which our NullTokenizer reads and a word-level tokenizer gives TRL
(id 99 is EOD / TRL's EOS), so both see the same tokens; the answers have different lengths, so IPO's
per-token normalisation and a per-micro-batch mean would show. TRL's global batch is the 4 pairs (the 8
sequences of ours, in 2 micro-batches), so its shuffling cannot change a mean. TRL is run with bf16 off
(its configs default to CPU autocast in bf16).
"""
import dataclasses
import json
import math
import re

import pytest
import torch

from megatron_lite.checkpointing import read_config
from megatron_lite.config import CheckpointConfig, DataConfig, LoggingConfig, OptimizerConfig, TrainingConfig
from megatron_lite.training import loop

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB, EOD, STEPS = 100, 99, 3
PAIRS = [("5 6 7", " 8 9", " 10"), ("11 12", " 13", " 14 15 16"), ("17 18 19 20", " 21 22", " 23 24"),
         ("25", " 26 27 28", " 29")]
FIELDS = ("dpo loss", "rewards chosen", "rewards rejected", "reward accuracy", "reward margin", "grad norm")
TRL_FIELDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(HF directory, our checkpoint, the pairs' JSONL) of a random Llama with init std 0.2 (gradients above the
    clipping norm of 1)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.2)
    root = tmp_path_factory.mktemp("dpo_trl")
    hf_dir, ckpt, data = str(root / "hf"), str(root / "ckpt"), root / "pairs.jsonl"
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", hf_dir,
                    "--save-dir", ckpt]) == 0
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    return hf_dir, ckpt, str(data)


def _trl_run(hf_dir: str, tmp_path, loss_type: str, **settings) -> list[tuple]:
    """TRL's loss, rewards and pre-clipping grad norm per step: DPOTrainer, or for simpo CPOTrainer and for orpo
    ORPOTrainer (``trl.experimental``); ``settings`` go to the trainer's config."""
    vocab = {str(i): i for i in range(EOD)} | {"<eos>": EOD}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                                     pad_token="<eos>")
    records = []
    if loss_type == "simpo":
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
        settings |= dict(loss_type="simpo")
    elif loss_type == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
    else:
        Config, Trainer = trl.DPOConfig, trl.DPOTrainer
        settings |= dict(loss_type=[loss_type])

    class Recording(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            metrics = self._metrics["train"] if hasattr(self, "_metrics") else self._stored_metrics["train"]
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.model.parameters()))
            records.append((loss.item(), *(metrics[name][-1] for name in TRL_FIELDS), norm.item(),
                            *metrics.get("nll_loss", [])[-1:]))
            return loss

    args = Config(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=STEPS,
                  learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.0, adam_epsilon=1e-8,
                  max_grad_norm=1.0, report_to="none", use_cpu=True, save_strategy="no", bf16=False, beta=0.1, seed=0,
                  disable_tqdm=True, **settings)
    pairs = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    Recording(model=transformers.LlamaForCausalLM.from_pretrained(hf_dir), args=args, train_dataset=pairs,
              processing_class=tokenizer).train()
    return records


def dpo_config(ckpt: str, data: str, *, loss_type: str = "sigmoid", steps=STEPS, **dpo):
    saved = read_config(ckpt)
    return dataclasses.replace(
        saved, model=dataclasses.replace(saved.model, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0),
        training=TrainingConfig(micro_batch_size=4, global_batch_size=8, train_iters=steps, dpo_loss_type=loss_type,
                                dpo_beta=0.1, **dpo),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0, adam_eps=1e-8, clip_grad=1.0, lr_decay_style="constant"),
        data=DataConfig(dpo=True, train_data_path=[data], tokenizer_type="NullTokenizer"),
        checkpoint=CheckpointConfig(pretrained_checkpoint=ckpt),
        logging=LoggingConfig(log_interval=1, log_memory=False))


def logged(output: str) -> list[tuple]:
    """Each iteration line's DPO fields, grad norm and (SimPO with an NLL term, ORPO) nll loss."""
    lines = [line for line in output.splitlines() if line.startswith(" iteration ")]
    return [tuple(float(match.group(1)) for name in FIELDS + ("nll loss",)
                  if (match := re.search(rf"\| {name}: ([-+.\dE]+) \|", line))) for line in lines]


# (our loss type and flags, TRL's settings): the reference-free losses against CPOTrainer (SimPO; with cpo_alpha,
# its NLL of the chosen answers) and ORPOTrainer; the reference's log-probabilities precomputed on both sides.
RUNS = {"sigmoid": ("sigmoid", {}, {}), "ipo": ("ipo", {}, {}), "hinge": ("hinge", {}, {}),
        "sigmoid, precomputed": ("sigmoid", dict(dpo_precompute_ref_log_probs=True),
                                 dict(precompute_ref_log_probs=True)),
        "simpo": ("simpo", dict(dpo_simpo_gamma=0.3, dpo_cpo_alpha=0.5), dict(simpo_gamma=0.3, cpo_alpha=0.5)),
        "orpo": ("orpo", {}, {})}


@pytest.mark.parametrize("run", RUNS)
def test_losses_rewards_and_grad_norms_equal_trl_every_iteration(imported, tmp_path, capsys, run):
    hf_dir, ckpt, data = imported
    loss_type, ours_flags, trl_settings = RUNS[run]
    expected = _trl_run(hf_dir, tmp_path, loss_type, **trl_settings)
    capsys.readouterr()
    state, _, _ = loop.pretrain(dpo_config(ckpt, data, loss_type=loss_type, **ours_flags))
    ours = logged(capsys.readouterr().out)
    assert len(ours) == len(expected) == STEPS
    assert state.losses == pytest.approx([row[0] for row in expected], abs=1e-5)
    for mine, theirs in zip(ours, expected):
        assert len(mine) == len(theirs)
        assert mine[:5] + mine[6:] == pytest.approx(theirs[:5] + theirs[6:], abs=1e-5)  # and the nll loss
        assert mine[5] == pytest.approx(theirs[5], abs=1e-3)  # the log prints 3 decimals
    if loss_type == "sigmoid":
        assert state.losses[0] == pytest.approx(math.log(2), abs=1e-7)  # the policy is the reference
        assert ours[1][3] > 0.5 and ours[-1][4] > ours[1][4]  # the chosen answers pull ahead


def test_label_smoothing_scales_the_first_gradient_by_one_minus_twice_epsilon(imported, capsys):
    """Conservative DPO: at h = 0 the gradient of -(1-e) log s(h) - e log s(-h) is (1 - 2e) that of e = 0
    (TRL's sigmoid loss has no smoothing to compare with)."""
    _, ckpt, data = imported
    norms = []
    for smoothing in (0.0, 0.25):
        state, _, _ = loop.pretrain(dpo_config(ckpt, data, dpo_label_smoothing=smoothing, steps=1))
        assert state.losses[0] == pytest.approx(math.log(2), abs=1e-7)
        norms.append(logged(capsys.readouterr().out)[0][5])
    assert norms[1] == pytest.approx(0.5 * norms[0], abs=2e-3)


def test_lora_dpo_exports_to_peft_and_its_test_loss_is_peft_against_the_base(imported, tmp_path, capsys):
    """--peft lora: the reference is the base with the adapters off. After 3 steps the test-set DPO loss (final
    adapters, the same pairs) equals the loss computed with PEFT loading our export, its adapters off for the
    reference; the iteration-1 loss is ln 2."""
    peft = pytest.importorskip("peft")
    import torch.nn.functional as F

    hf_dir, ckpt, data = imported
    config = dpo_config(ckpt, data)
    config = dataclasses.replace(
        config, peft=dataclasses.replace(config.peft, peft="lora", lora_rank=4, lora_alpha=8.0),
        data=dataclasses.replace(config.data, test_data_path=[data]),
        training=dataclasses.replace(config.training, eval_iters=1),
        checkpoint=dataclasses.replace(config.checkpoint, save=str(tmp_path / "lora")))
    state, _, _ = loop.pretrain(config)
    assert state.losses[0] == pytest.approx(math.log(2), abs=1e-7) and state.losses[-1] < state.losses[0]
    test_loss = float(re.search(r"on test set \| dpo loss value: ([-+.\dE]+) \|", capsys.readouterr().out).group(1))
    assert convert(["--target-format", "peft", "--load-dir", str(tmp_path / "lora"),
                    "--save-dir", str(tmp_path / "peft")]) == 0
    model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(hf_dir),
                                           str(tmp_path / "peft")).eval()

    def log_prob(prompt: str, answer: str) -> torch.Tensor:
        ids = [int(t) for t in (prompt + answer).split()] + [EOD]
        start = len(prompt.split())
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[start - 1:].sum()

    def sides():
        return torch.stack([torch.stack([log_prob(p, c), log_prob(p, r)]) for p, c, r in PAIRS])
    policy = sides()
    with model.disable_adapter():
        reference = sides()
    ratios = policy - reference
    expected = -F.logsigmoid(0.1 * (ratios[:, 0] - ratios[:, 1])).mean()
    assert test_loss == pytest.approx(expected.item(), abs=1e-5)


def test_the_command_line_trains_dpo_with_its_flags(imported, capsys):
    """--dpo and its loss flags through pretrain_gpt's main, the model from the checkpoint: hinge at h = 0 is 1."""
    from megatron_lite.pretrain_gpt import main

    _, ckpt, data = imported
    assert main(["--dpo", "--pretrained-checkpoint", ckpt, "--use-checkpoint-args", "--train-data-path", data,
                 "--tokenizer-type", "NullTokenizer", "--dpo-loss-type", "hinge", "--dpo-beta", "0.2",
                 "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "1",
                 "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]) == 0
    assert "| dpo loss: 1.000000E+00 | rewards chosen: 0.000000E+00 |" in capsys.readouterr().out
