"""--grpo's bad input: one error naming the problem and the fix, before any weight changes.

A reward function that raises, returns the wrong number of rewards or a NaN names itself and the prompt, and the
run stops in the first iteration before its update (the command line prints one ``error:`` line, exit code 2);
a prompt record without its field names the file and line at start-up; and the flags that cannot work together
are refused by name.
"""
import json

import pytest

from megatron_lite.config import (Config, ConfigError, DataConfig, GRPOConfig, ModelConfig, ParallelConfig,
                                  TrainingConfig)
from megatron_lite.data.sft import SFTDataError
from megatron_lite.data.sft.prompts import count_prompts, parse_prompt_record
from megatron_lite.training import rewards

MODEL = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16, vocab_size=16)
REWARDS = '''
def raises(prompts, completions, **kwargs):
    return [1 / (len(c.split()) - len(c.split())) if p == "3 4" else 0.0 for p, c in zip(prompts, completions)]


def too_few(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def nan(prompts, completions, **kwargs):
    return [float("nan")] + [0.0] * (len(completions) - 1)
'''


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i} {i + 1}"}) + "\n" for i in range(4)))
    (tmp_path / "reward.py").write_text(REWARDS)
    return str(tmp_path / "prompts.jsonl"), str(tmp_path / "reward.py")


def _argv(data: str, reward: str, tmp_path) -> list[str]:
    """Every prompt in the first batch of completions (4 prompts x 4), a checkpoint after every iteration."""
    return ["--grpo", "--train-data-path", data, "--reward-function", reward, "--tokenizer-type", "NullTokenizer",
            "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
            "--vocab-size", "16", "--micro-batch-size", "4", "--global-batch-size", "16", "--grpo-group-size", "4",
            "--max-new-tokens", "3", "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]


@pytest.mark.parametrize("name, says", [
    ("raises", "reward function {reward}:raises raised ZeroDivisionError: division by zero, scoring the completion"),
    ("too_few", "reward function {reward}:too_few returned 15 rewards for 16 completions"),
    ("nan", "reward function {reward}:nan returned nan for the completion")])
def test_a_failing_reward_function_is_named_with_the_prompt_and_stops_before_the_update(files, tmp_path, capsys,
                                                                                        name, says):
    from megatron_lite.pretrain_gpt import main

    data, reward = files
    assert main(_argv(data, f"{reward}:{name}", tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and says.format(reward=reward) in err, err
    assert "of the prompt '" in err  # the prompt it failed on, or the first of the batch
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()  # no iteration completed
    if name == "raises":
        assert "of the prompt '3 4'" in err  # the one prompt it fails on, found by calling it one at a time


def test_a_prompt_record_without_its_field_names_the_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1 2"}) + "\n" + json.dumps({"question": "3 4"}) + "\n")
    with pytest.raises(SFTDataError, match=rf'{data}:2: a --grpo record needs "prompt" .* keys \[\'question\'\]'):
        count_prompts([str(data)])
    with pytest.raises(SFTDataError, match="ends with the assistant's message"):
        parse_prompt_record({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    prompt = parse_prompt_record({"messages": [{"role": "user", "content": "q"}], "answer": "4"})
    assert prompt.conversational and prompt.columns == {"answer": "4"}


def test_the_command_line_checks_the_prompts_before_the_model(tmp_path, capsys, files):
    from megatron_lite.pretrain_gpt import main

    _, reward = files
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "1 2"}) + "\n")
    assert main(_argv(str(data), f"{reward}:nan", tmp_path)) == 2
    assert f"{data}:1: a --grpo record needs" in capsys.readouterr().err


def test_reward_functions_that_do_not_load_are_named(tmp_path):
    (tmp_path / "r.py").write_text("def score(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ConfigError, match=r"defines no function 'scor' \(its functions: score\)"):
        rewards.load_reward_functions([f"{tmp_path}/r.py:scor"])
    with pytest.raises(ConfigError, match="is not a file"):
        rewards.load_reward_functions([f"{tmp_path}/missing.py:score"])


def _config(**changes) -> Config:
    sections = dict(model=ModelConfig(**MODEL), training=TrainingConfig(),
                    data=DataConfig(grpo=True, train_data_path=["p.jsonl"], tokenizer_type="NullTokenizer"),
                    grpo=GRPOConfig(reward_function=["r.py:f"]))
    return Config(**(sections | changes))


@pytest.mark.parametrize("changes, says", [
    (dict(grpo=GRPOConfig()), "--grpo needs --reward-function FILE.py:NAME"),
    (dict(grpo=GRPOConfig(reward_function=["r.py:f"], grpo_beta=0.1)), "--grpo-beta > 0 needs a reference model"),
    (dict(parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)), "drop --sequence-parallel"),
    (dict(data=DataConfig(grpo=True, train_data_path=["p.jsonl"], valid_data_path=["v.jsonl"],
                          tokenizer_type="NullTokenizer")), "--grpo has no validation loss"),
    (dict(data=DataConfig(mock_data=True), grpo=GRPOConfig(reward_function=["r.py:f"])), "add --grpo")])
def test_flags_that_cannot_work_are_refused_by_name(changes, says):
    with pytest.raises(ConfigError, match=says):
        _config(**changes)


def test_bad_grpo_values_are_refused():
    with pytest.raises(ConfigError, match="--grpo-group-size must be >= 2"):
        GRPOConfig(grpo_group_size=1)
    with pytest.raises(ConfigError, match="--reward-weights gives 1 weights for 2"):
        GRPOConfig(reward_function=["a.py:f", "a.py:g"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="FILE.py:NAME"):
        GRPOConfig(reward_function=["a.py"])


def test_the_reward_flag_repeats_or_takes_several_functions():
    from megatron_lite.cli.arguments import parse_args

    flags = ["--grpo", "--train-data-path", "p.jsonl", "--tokenizer-type", "NullTokenizer", "--num-layers", "1",
             "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "16"]
    config = parse_args(flags + ["--reward-function", "r.py:a", "r.py:b", "--reward-function", "s.py:c",
                                 "--reward-weights", "1", "0.5", "2", "--grpo-epsilon-high", "0.28"])
    assert config.grpo.reward_function == ["r.py:a", "r.py:b", "s.py:c"] and config.grpo.weights() == [1, 0.5, 2]
    assert config.grpo.epsilon_high == 0.28 and config.grpo.grpo_epsilon == 0.2


def test_a_reward_file_that_is_missing_fails_before_the_model_is_built(files, tmp_path, capsys):
    from megatron_lite.pretrain_gpt import main

    data, _ = files
    assert main(_argv(data, f"{tmp_path}/missing.py:score", tmp_path)) == 2
    out, err = capsys.readouterr()
    assert f"error: --reward-function {tmp_path}/missing.py:score: {tmp_path}/missing.py is not a file" in err
    assert "memory per rank" not in out  # printed once the model and optimizer exist
