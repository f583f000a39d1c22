"""--grpo equals TRL's GRPOTrainer: for the same tiny Llama, completions, rewards and hyper-parameters, the loss, the
logged reward, reward std, kl, completion length and clip ratio, and the gradient norm at every iteration (fp32).

Our run samples its completions and writes them (--grpo-log-completions); TRL's trainer is then driven through
its own scoring, advantage and loss code with its generation replaced by ours (``_generate_single_turn``
returns our completions of each prompt), so everything after sampling is TRL's. Each batch of completions
trains two iterations (mu 2: the second step's ratio is to the sampling policy and clips), with a KL penalty
to the reference (beta 0.1) and a temperature, whose logits / temperature both sides score. The prompts are
space-separated ids, which our NullTokenizer reads and a word-level tokenizer gives TRL (id 99 is EOD / EOS).
"""
import dataclasses
import importlib.util
import json
import re

import pytest
import torch

from megatron_lite.checkpointing import read_config
from megatron_lite.config import (CheckpointConfig, DataConfig, GRPOConfig, LoggingConfig, OptimizerConfig,
                                  ParallelConfig, TrainingConfig)
from megatron_lite.inference.loading import read_checkpoint_config
from megatron_lite.training import loop

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB, EOD, STEPS, GROUP, NEW_TOKENS, LR = 100, 99, 4, 4, 5, 5e-3
PROMPTS = ["5 6 7", "11 12 13"]
REWARDS = '''
def low_ids(prompts, completions, completion_ids, **kwargs):
    return [sum(i < 50 for i in ids) / len(ids) for ids in completion_ids]


def short(prompts, completions, **kwargs):
    return [-len(text.split()) / 5 for text in completions]
'''
FIELDS = ("grpo loss", "reward", "reward std", "kl", "entropy", "completion length", "clip ratio", "grad norm")
TRL_FIELDS = ("reward", "reward_std", "kl", "entropy", "completions/mean_length", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(HF directory, our checkpoint, the prompts' JSONL, the reward file) of a random Llama, init std 0.2."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.2)
    root = tmp_path_factory.mktemp("grpo_trl")
    hf_dir, ckpt, data, reward_file = str(root / "hf"), str(root / "ckpt"), root / "prompts.jsonl", root / "reward.py"
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", hf_dir,
                    "--save-dir", ckpt]) == 0
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    reward_file.write_text(REWARDS)
    return hf_dir, ckpt, str(data), str(reward_file)


def grpo_config(ckpt: str, data: str, reward_file: str, log: str, *, steps=STEPS, **grpo) -> "loop.Config":
    saved = read_config(ckpt)
    settings = dict(reward_function=[f"{reward_file}:low_ids", f"{reward_file}:short"], reward_weights=[1.0, 0.5],
                    grpo_group_size=GROUP, max_new_tokens=NEW_TOKENS, temperature=0.9, grpo_beta=0.1,
                    grpo_iterations=2, grpo_log_completions=log)
    return dataclasses.replace(
        saved, model=dataclasses.replace(saved.model, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0),
        training=TrainingConfig(micro_batch_size=4, global_batch_size=GROUP * len(PROMPTS), train_iters=steps),
        optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, adam_eps=1e-8, clip_grad=1.0, lr_decay_style="constant"),
        data=DataConfig(grpo=True, train_data_path=[data], tokenizer_type="NullTokenizer"),
        checkpoint=CheckpointConfig(pretrained_checkpoint=ckpt), grpo=GRPOConfig(**(settings | grpo)),
        logging=LoggingConfig(log_interval=1, log_memory=False))


def logged(output: str, fields=FIELDS) -> list[dict]:
    """Each iteration line's GRPO fields and grad norm."""
    lines = [line for line in output.splitlines() if line.startswith(" iteration ")]
    return [{name: float(match.group(1)) for name in fields
             if (match := re.search(rf"\| {name}: ([-+.\dE]+) \|", line))} for line in lines]


def _trl_run(hf_dir: str, tmp_path, completions: dict, reward_file: str, steps=STEPS, micro_batch=GROUP * len(PROMPTS),
             **settings) -> list[dict]:
    """TRL's per-step loss, metrics and pre-clipping gradient norm, sampling replaced by our completions
    (``completions[(batch, prompt ids)]``: the completions of that prompt in our batch, in order); with a
    ``micro_batch`` below the batch, one record per micro-batch (gradient accumulation)."""
    vocab = {str(i): i for i in range(EOD)} | {"<eos>": EOD}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                                     pad_token="<eos>")
    spec = importlib.util.spec_from_file_location("grpo_trl_rewards", reward_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    records, batches = [], []

    class OurCompletions(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            queues = {key: list(value) for key, value in completions.items() if key[0] == len(batches)}
            batches.append(prompt_ids)
            return [queues[(len(batches) - 1, tuple(ids))].pop(0) for ids in prompt_ids], None

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            metrics = self._metrics["train"]
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.model.parameters()))
            records.append({"grpo loss": loss.item(), "grad norm": norm.item(),
                            **{ours: metrics[theirs][-1] for ours, theirs in zip(FIELDS[1:7], TRL_FIELDS)
                               if metrics.get(theirs)}})
            return loss

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=micro_batch,
                          gradient_accumulation_steps=GROUP * len(PROMPTS) // micro_batch,
                          num_generations=GROUP, max_completion_length=NEW_TOKENS, max_steps=steps,
                          learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, adam_epsilon=1e-8,
                          max_grad_norm=1.0, report_to="none", use_cpu=True, save_strategy="no", bf16=False,
                          logging_steps=1, seed=0, disable_tqdm=True, **settings)
    OurCompletions(model=transformers.LlamaForCausalLM.from_pretrained(hf_dir),
                   reward_funcs=[module.low_ids, module.short], args=args,
                   train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                   processing_class=tokenizer).train()
    return records


def _completions_by_batch(log: str, iterations: int) -> dict:
    """(batch, prompt ids) -> our completions of that prompt in that batch, from --grpo-log-completions."""
    completions = {}
    for line in open(log):
        record = json.loads(line)
        batch = (record["iteration"] - 1) // iterations
        prompt = tuple(int(token) for token in record["prompt"].split())
        completions.setdefault((batch, prompt), []).append(record["completion_ids"])
    return completions


def test_loss_and_logged_numbers_equal_trl_every_iteration(imported, tmp_path, capsys):
    hf_dir, ckpt, data, reward_file = imported
    log = str(tmp_path / "completions.jsonl")
    config = grpo_config(ckpt, data, reward_file, log)
    config.checkpoint.save = str(tmp_path / "trained")
    state, _, _ = loop.pretrain(config)
    ours = logged(capsys.readouterr().out)
    expected = _trl_run(hf_dir, tmp_path, _completions_by_batch(log, 2), reward_file, beta=0.1, num_iterations=2,
                        reward_weights=[1.0, 0.5], temperature=0.9)
    assert len(ours) == len(expected) == STEPS
    assert state.losses == pytest.approx([row["grpo loss"] for row in expected], abs=1e-5)
    for iteration, (mine, theirs) in enumerate(zip(ours, expected)):
        for name in ("kl", "entropy", "clip ratio") + (("reward", "reward std", "completion length")
                                                       if iteration % 2 == 0 else ()):
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), (iteration, name)
        assert mine["grad norm"] == pytest.approx(theirs["grad norm"], abs=1e-3)  # the log prints 3 decimals
    assert ours[0]["kl"] == 0 and ours[0]["clip ratio"] == 0  # the policy is the reference and the sampler
    assert max(row["clip ratio"] for row in ours[1::2]) > 0  # the second step of a batch clips: the test sees it
    # generate and evaluate run the trained weights without the run's reference or reward functions
    assert not read_checkpoint_config(str(tmp_path / "trained"), ParallelConfig()).data.grpo


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_the_other_normalisations_equal_trl_without_a_reference(imported, tmp_path, capsys, loss_type):
    """--grpo-loss-type grpo (per completion) and dr_grpo (over --max-new-tokens), with --grpo-beta 0 (no reference
    model, no kl field) and one iteration per batch (the ratio is 1): loss and grad norm per iteration as TRL's."""
    hf_dir, ckpt, data, reward_file = imported
    log = str(tmp_path / "completions.jsonl")
    config = grpo_config(ckpt, data, reward_file, log, steps=2, grpo_beta=0.0, grpo_iterations=1, temperature=1.0,
                         grpo_loss_type=loss_type)
    state, _, _ = loop.pretrain(config)
    ours = logged(capsys.readouterr().out)
    expected = _trl_run(hf_dir, tmp_path, _completions_by_batch(log, 1), reward_file, steps=2, beta=0.0,
                        num_iterations=1, reward_weights=[1.0, 0.5], temperature=1.0, loss_type=loss_type)
    assert state.losses == pytest.approx([row["grpo loss"] for row in expected], abs=1e-5)
    assert [row["grad norm"] for row in ours] == pytest.approx([row["grad norm"] for row in expected], abs=1e-3)
    assert all("kl" not in row for row in ours)


def test_bnpo_averages_per_micro_batch_as_trl_does_per_local_batch(imported, tmp_path, capsys, monkeypatch):
    """--grpo-loss-type bnpo: each micro-batch's mean over its completion tokens, then the mean over micro-batches.
    TRL's "local batch" is ours: 2 micro-batches of 4 completions against per_device_train_batch_size 4 with 2
    accumulation steps, TRL's shuffle of the batch of completions replaced by none so that its micro-batches hold
    ours. --seed 10 samples a short completion in each batch (asserted), so the micro-batches differ in tokens and
    bnpo differs from dapo: loss and grad norm per iteration as TRL's."""
    hf_dir, ckpt, data, reward_file = imported
    runs = {}
    for loss_type in ("bnpo", "dapo"):
        log = str(tmp_path / f"{loss_type}.jsonl")
        config = grpo_config(ckpt, data, reward_file, log, steps=2, grpo_beta=0.0, grpo_iterations=1,
                             grpo_loss_type=loss_type)
        config.training.seed = 10
        state, _, _ = loop.pretrain(config)
        runs[loss_type] = state.losses, logged(capsys.readouterr().out)
    lengths = [len(json.loads(line)["completion_ids"]) for line in open(tmp_path / "bnpo.jsonl")]
    assert all(sum(lengths[i:i + GROUP]) != sum(lengths[i + GROUP:i + 2 * GROUP]) for i in (0, 2 * GROUP))
    monkeypatch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    expected = _trl_run(hf_dir, tmp_path, _completions_by_batch(str(tmp_path / "bnpo.jsonl"), 1), reward_file,
                        steps=2, micro_batch=GROUP, beta=0.0, num_iterations=1, reward_weights=[1.0, 0.5],
                        temperature=0.9, loss_type="bnpo")
    losses, ours = runs["bnpo"]
    step_losses = [expected[i]["grpo loss"] + expected[i + 1]["grpo loss"] for i in (0, 2)]  # each micro-batch's
    assert losses == pytest.approx(step_losses, abs=1e-6) and losses != pytest.approx(runs["dapo"][0], abs=1e-4)
    assert [row["grad norm"] for row in ours] == pytest.approx([row["grad norm"] for row in expected[1::2]], abs=1e-3)
