"""--grpo under tensor x pipeline and data parallelism, and with LoRA, samples and trains like one process; a toy
reward rises on two processes.

A Llama-style model starts from a checkpoint of its own (one mock-data step) and trains 4 GRPO iterations, two per
batch of completions (the second's ratio is to the sampling policy), with a KL penalty (beta 0.1) to the frozen
reference: at tp2 x pp2 (generation's tokens cross the pipeline and the reference's log-probabilities reach the
last stage), pp2 x dp2 (each data-parallel rank samples its share of the prompts) with the distributed optimizer
gathering the updated weights behind the next forward (sampling waits for them), and LoRA at tp2 x dp2 (the
reference is the base with the adapters off). Each layout samples the same completions (a prompt's generator
is seeded by its place in the run, not by the rank) and logs the same losses as one process.
"""
import json
import random

import pytest

from megatron_lite.config import (CheckpointConfig, Config, DataConfig, GRPOConfig, LoggingConfig, ModelConfig,
                                  OptimizerConfig, ParallelConfig, PeftConfig, TrainingConfig)
from tests.distributed import run_distributed
from tests.parity import assert_losses_match

STEPS = 4
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16, vocab_size=64,
             normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
RUNS = {"tp2 x pp2": dict(tp=2, pp=2), "pp2 x dp2, distributed optimizer": dict(pp=2, zero1=True),
        "LoRA, tp2 x dp2": dict(tp=2, lora=True)}
REWARD = '''
def small_ids(prompts, completions, completion_ids, **kwargs):
    return [sum(i < 20 for i in ids) / len(ids) for ids in completion_ids]


def sevens(prompts, completions, **kwargs):
    return [text.split().count("7") / max(1, len(text.split())) for text in completions]
'''


@pytest.fixture()
def files(tmp_path):
    rng = random.Random(0)
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(str(rng.randint(0, 60)) for _ in range(rng.randint(1, 4)))}) + "\n"
        for _ in range(6)))
    (tmp_path / "reward.py").write_text(REWARD)
    return str(tmp_path / "prompts.jsonl"), str(tmp_path / "reward.py")


def _config(data: str, reward: str, root: str, name: str, *, tp=1, pp=1, lora=False, zero1=False,
            grpo=True) -> Config:
    return Config(
        model=ModelConfig(**LLAMA),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                use_distributed_optimizer=zero1, overlap_param_gather=zero1),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=STEPS if grpo else 1),
        optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-6, clip_grad=1.0, lr_decay_style="constant"),
        data=(DataConfig(grpo=True, train_data_path=[data], tokenizer_type="NullTokenizer") if grpo
              else DataConfig(mock_data=True)),
        grpo=GRPOConfig(reward_function=[f"{reward}:small_ids"], grpo_group_size=4, max_new_tokens=4,
                        temperature=0.8, grpo_beta=0.1, grpo_iterations=2,
                        grpo_log_completions=f"{root}/{name}.jsonl") if grpo else GRPOConfig(),
        peft=PeftConfig(peft="lora", lora_rank=4, lora_alpha=8.0) if lora else PeftConfig(),
        checkpoint=CheckpointConfig(pretrained_checkpoint=f"{root}/base") if grpo else CheckpointConfig(
            save=f"{root}/base"),
        logging=LoggingConfig(log_interval=STEPS, log_memory=False))


def _references(rank, world_size, data, reward, root):
    """The base checkpoint (one mock-data step), then every run's single-process losses."""
    from megatron_lite.training.loop import pretrain

    pretrain(_config(data, reward, root, "base", grpo=False), keep_process_group=True)
    return {name: pretrain(_config(data, reward, root, f"{name} reference", lora=run.get("lora", False)),
                           keep_process_group=True)[0].losses for name, run in RUNS.items()}


def _layouts(rank, world_size, data, reward, root):
    from megatron_lite.training.loop import pretrain

    return {name: pretrain(_config(data, reward, root, name, **run), keep_process_group=True)[0].losses
            for name, run in RUNS.items()}


def _completions(path: str) -> list[tuple]:
    return [(r["iteration"], r["prompt"], r["completion_ids"], r["reward"]) for r in map(json.loads, open(path))]


def test_grpo_layouts_sample_and_train_like_one_process(files, tmp_path):
    data, reward = files
    (reference,) = run_distributed(_references, 1, args=(data, reward, str(tmp_path)))
    per_rank = run_distributed(_layouts, 4, args=(data, reward, str(tmp_path)), timeout=600)
    for name in RUNS:
        expected = _completions(f"{tmp_path}/{name} reference.jsonl")
        assert len(expected) == 8 * STEPS // 2 and len({tuple(c[2]) for c in expected}) > 1, name
        assert _completions(f"{tmp_path}/{name}.jsonl") == expected, name
        # The losses are about 0.01 (advantages sum to 0 in a group): 1e-4 of that is 1e-6, fp32's noise through exp.
        assert_losses_match([losses[name] for losses in per_rank], reference[name], STEPS, name, rel=1e-4)


def _toy(rank, world_size, data, reward, root):
    """Two data-parallel ranks learn, from scratch, to write 7s: 16 iterations of 4 prompts x 4 completions."""
    from megatron_lite.training.loop import pretrain

    model = dict(LLAMA, vocab_size=16, num_layers=1, init_method_std=0.02)
    config = Config(model=ModelConfig(**model),
                    training=TrainingConfig(micro_batch_size=8, global_batch_size=16, train_iters=16),
                    optimizer=OptimizerConfig(lr=2e-2, lr_decay_style="constant"),
                    data=DataConfig(grpo=True, train_data_path=[data], tokenizer_type="NullTokenizer"),
                    grpo=GRPOConfig(reward_function=[f"{reward}:sevens"], grpo_group_size=4, max_new_tokens=4,
                                    grpo_log_completions=f"{root}/toy.jsonl"),
                    logging=LoggingConfig(log_interval=16, log_memory=False))
    pretrain(config, keep_process_group=True)


def test_a_toy_reward_rises_on_two_processes(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i} {i + 1}"}) + "\n" for i in range(8)))
    (tmp_path / "reward.py").write_text(REWARD)
    run_distributed(_toy, 2, args=(str(tmp_path / "prompts.jsonl"), str(tmp_path / "reward.py"), str(tmp_path)))
    by_iteration = {}
    for record in map(json.loads, open(tmp_path / "toy.jsonl")):
        by_iteration.setdefault(record["iteration"], []).append(record["reward"])
    means = [sum(rewards) / len(rewards) for _, rewards in sorted(by_iteration.items())]
    assert len(means) == 16 and all(len(rewards) == 16 for rewards in by_iteration.values())
    assert sum(means[-4:]) / 4 > sum(means[:4]) / 4 + 0.4, means  # from about 1 in 14 tokens to most of them
