"""A --grpo run stopped and resumed (--load) samples the same completions and logs the same losses as one that ran
through: a prompt's sampling is seeded by its batch and place, not by a random state the checkpoint would have to
carry, and the batches of completions resume at the iteration the checkpoint holds."""
import json

from megatron_lite.config import (CheckpointConfig, Config, DataConfig, GRPOConfig, LoggingConfig, ModelConfig,
                                  OptimizerConfig, TrainingConfig)
from megatron_lite.training.loop import pretrain

REWARD = "def sevens(prompts, completions, **kwargs):\n    return [c.split().count('7') / 3 for c in completions]\n"


def _config(tmp_path, name: str, exit_interval=None, **checkpoint) -> Config:
    return Config(model=ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=12,
                                    hidden_dropout=0.0, attention_dropout=0.0),
                  training=TrainingConfig(micro_batch_size=4, global_batch_size=8, train_iters=4,
                                          exit_interval=exit_interval),
                  optimizer=OptimizerConfig(lr=1e-2, lr_decay_style="constant"),
                  data=DataConfig(grpo=True, train_data_path=[str(tmp_path / "prompts.jsonl")],
                                  tokenizer_type="NullTokenizer"),
                  grpo=GRPOConfig(reward_function=[f"{tmp_path}/reward.py:sevens"], grpo_group_size=4,
                                  max_new_tokens=3, grpo_log_completions=str(tmp_path / f"{name}.jsonl")),
                  checkpoint=CheckpointConfig(**checkpoint), logging=LoggingConfig(log_interval=1, log_memory=False))


def test_a_resumed_run_samples_and_trains_as_one_that_ran_through(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i} {i + 1}"}) + "\n" for i in range(6)))
    (tmp_path / "reward.py").write_text(REWARD)
    through = pretrain(_config(tmp_path, "through"))[0]
    pretrain(_config(tmp_path, "first", exit_interval=2, save=str(tmp_path / "ckpt")))  # stops after 2, saved
    resumed = pretrain(_config(tmp_path, "second", save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt")))[0]
    assert resumed.losses == through.losses  # the checkpoint's two, then two more: bit for bit
    lines = [json.loads(c) for c in open(tmp_path / "through.jsonl")]
    split = [json.loads(c) for name in ("first", "second") for c in open(tmp_path / f"{name}.jsonl")]
    assert [(c["iteration"], c["completion_ids"]) for c in split] == [(c["iteration"], c["completion_ids"])
                                                                     for c in lines]
