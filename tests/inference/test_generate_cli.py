"""``python -m megatron_lite.generate`` as a user runs it: a prompts file in, a responses file out,
the same on 2 ranks at tp=2, pp=2, dp=2 and (a mixture of experts) ep=2 as in one
process; the checkpoint's own tokenizer
when no tokenizer flag is given; one clean ``error:`` line for a bad --load, tokenizer or prompt.
The command's ``main`` runs in this process, or on 2 forked ranks (``run_command_on_ranks``).
"""
import json
import os
import shutil

import pytest

from megatron_lite.checkpointing import read_config
from megatron_lite.checkpointing.offline import write_checkpoint
from megatron_lite.config import DataConfig
from megatron_lite.data.sft import format_prompt, response_text
from megatron_lite.generate import main
from megatron_lite.inference.text_generation import generate
from megatron_lite.tokenizer.gpt2_bpe import EOD_TOKEN, GPT2BPETokenizer, bytes_to_unicode
from tests.distributed import run_command_on_ranks
from tests.inference.models import build, config_of
from tests.test_user_errors import _assert_one_clean_error

PROMPTS = ["The cat", "Once upon a time there was", "x", "def main():\n    return"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint saved at tp=2 whose config records a byte-level GPT-2 tokenizer (no merges:
    257 ids, one per byte and EOD) and the ChatML template, and the model it holds, built here."""
    root = tmp_path_factory.mktemp("generate")
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    vocab = {char: byte for byte, char in bytes_to_unicode().items()} | {EOD_TOKEN: 256}
    (tokenizer_dir / "vocab.json").write_text(json.dumps(vocab))
    (tokenizer_dir / "merges.txt").write_text("#version: 0.2\n")
    config = config_of("rope_gqa", tp=2, vocab_size=257, seq_length=128)
    config.data = DataConfig(data_path=["corpus_text_document"], tokenizer_type="GPT2BPETokenizer",
                             vocab_file=str(tokenizer_dir / "vocab.json"), merge_file=str(tokenizer_dir / "merges.txt"),
                             sft_tokenizer_prompt_format="chatml")
    model, _ = build("rope_gqa", vocab_size=257, seq_length=128)
    weights = dict(model.named_parameters())
    write_checkpoint(str(root / "ckpt"), config, lambda name: weights[name].detach(), iteration=0)
    return str(root / "ckpt"), model, GPT2BPETokenizer(config.data.vocab_file, config.data.merge_file)


def _prompts_file(tmp_path, prompts=PROMPTS) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages" if isinstance(p, list) else "prompt": p}) + "\n"
                            for p in prompts))
    return str(path)


def _responses(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("prompt_format", [None, "plain"], ids=["recorded-chatml", "plain"])
def test_a_prompts_file_gives_one_response_per_prompt_with_the_checkpoints_tokenizer(checkpoint, tmp_path,
                                                                                     prompt_format):
    """No tokenizer flag: the recorded tokenizer and chat template, as training tokenized a conversation."""
    load, model, tokenizer = checkpoint
    prompts = [*PROMPTS, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    output = tmp_path / "responses.jsonl"
    chosen = ["--sft-tokenizer-prompt-format", prompt_format] if prompt_format else []
    assert main(["--load", load, "--prompts-file", _prompts_file(tmp_path, prompts), "--output-file", str(output),
                 "--greedy", "--max-new-tokens", "12", "--micro-batch-size", "3", *chosen]) == 0
    prompt_format = prompt_format or "chatml"
    conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    expected = [generate(model, [format_prompt(c, tokenizer, prompt_format)], max_new_tokens=12, eod=tokenizer.eod,
                         greedy=True)[0] for c in conversations]
    responses = _responses(output)
    assert [r["prompt"] for r in responses] == prompts
    assert [r["response"] for r in responses] == [response_text(ids, tokenizer, prompt_format) for ids in expected]
    assert len({r["response"] for r in responses}) == len(prompts)
    if prompt_format == "plain":  # the text as written
        assert format_prompt(conversations[0], tokenizer, "plain") == tokenizer.tokenize(PROMPTS[0])


@pytest.fixture(scope="module")
def moe_checkpoint(checkpoint, tmp_path_factory):
    """The same tokenizer with a mixture of 4 experts, top-2, in every layer."""
    config = config_of("rope_gqa", vocab_size=257, seq_length=128, num_experts=4, moe_ffn_hidden_size=32)
    config.data = read_config(checkpoint[0]).data
    model, _ = build("rope_gqa", vocab_size=257, seq_length=128, num_experts=4, moe_ffn_hidden_size=32)
    weights = dict(model.named_parameters())
    root = str(tmp_path_factory.mktemp("generate_moe") / "ckpt")
    write_checkpoint(root, config, lambda name: weights[name].detach(), iteration=0)
    return root


SAMPLED = ["--temperature", "0.9", "--top-p", "0.9", "--seed", "11"]
# (checkpoint fixture, flags, prompts, sampling): the data-parallel layouts split the prompts; 5 prompts in batches
# of 2 are 3 batches (0 and 2 on the first rank), so at ep2 the second runs a filler to stay in step.
LAYOUTS = {"tp2": ("checkpoint", ["--tensor-model-parallel-size", "2"], PROMPTS, SAMPLED),
           "pp2": ("checkpoint", ["--pipeline-model-parallel-size", "2"], PROMPTS, SAMPLED),
           "dp2": ("checkpoint", [], PROMPTS, SAMPLED),
           "cp2": ("checkpoint", ["--context-parallel-size", "2"], PROMPTS, SAMPLED),
           "ep2": ("moe_checkpoint", ["--expert-model-parallel-size", "2"], [*PROMPTS, "One more"], SAMPLED),
           "ep2-greedy": ("moe_checkpoint", ["--expert-model-parallel-size", "2"], [*PROMPTS, "One more"],
                          ["--greedy"])}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_give_the_responses_of_one_process(request, tmp_path, layout):
    fixture, layout, prompts, sampling = LAYOUTS[layout]
    load = request.getfixturevalue(fixture)
    load = load if isinstance(load, str) else load[0]
    sampling = ["--prompts-file", _prompts_file(tmp_path, prompts), "--max-new-tokens", "10", "--micro-batch-size",
                "2", *sampling]
    assert main(["--load", load, *sampling, "--output-file", str(tmp_path / "one.jsonl")]) == 0
    results = run_command_on_ranks(main, ["--load", load, *sampling, "--output-file", str(tmp_path / "two.jsonl"),
                                          *layout], world_size=2)
    assert [code for code, _ in results] == [0, 0], results
    assert _responses(tmp_path / "two.jsonl") == _responses(tmp_path / "one.jsonl")
    assert len({r["response"] for r in _responses(tmp_path / "one.jsonl")}) > 1
    # rank 0 writes and reports
    assert "".join(output for _, output in results).count(f"wrote {len(prompts)} responses") == 1


def test_one_prompt_prints_a_sample(checkpoint, capsys):
    assert main(["--load", checkpoint[0], "--prompt", "The cat", "--max-new-tokens", "5", "--top-k", "0"]) == 0
    assert "\n--- sample ---\nThe cat" in capsys.readouterr().out


def test_a_missing_load_on_two_ranks_is_one_clean_error(tmp_path):
    results = run_command_on_ranks(main, ["--load", str(tmp_path / "nowhere"), "--prompt", "hi"], world_size=2)
    assert [code for code, _ in results] == [2, 2]
    _assert_one_clean_error("".join(output for _, output in results), "--load", "no such directory")


@pytest.mark.parametrize("load", ["", "empty"])
def test_an_empty_load_is_a_clean_error(tmp_path, capsys, load):
    (tmp_path / "empty").mkdir()
    assert main(["--load", str(tmp_path / load) if load else "", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --load") and "checkpoint" in err and "Traceback" not in err


def test_a_moved_tokenizer_names_the_flags_to_pass(checkpoint, tmp_path, capsys):
    load = checkpoint[0]
    moved = tmp_path / "ckpt"
    shutil.copytree(load, moved)
    tokenizer_dir = os.path.join(os.path.dirname(load), "tokenizer")
    shutil.move(tokenizer_dir, tmp_path / "tokenizer")
    try:
        assert main(["--load", str(moved), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert "--vocab-file" in err and "--merge-file" in err and "are gone" in err and "--tokenizer-type" in err
        assert main(["--load", str(moved), "--prompt", "hi", "--max-new-tokens", "2", "--tokenizer-type",
                     "GPT2BPETokenizer",
                     "--vocab-file", str(tmp_path / "tokenizer/vocab.json"),
                     "--merge-file", str(tmp_path / "tokenizer/merges.txt")]) == 0
    finally:
        shutil.move(tmp_path / "tokenizer", tokenizer_dir)


def test_a_bad_prompt_line_is_named(checkpoint, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n{"text": "no prompt"}\n')
    assert main(["--load", checkpoint[0], "--prompts-file", str(path)]) == 2
    assert f"{path}:3:" in capsys.readouterr().err
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    assert main(["--load", checkpoint[0], "--prompts-file", str(path)]) == 2
    assert f"{path}:1: the conversation ends with the assistant's message" in capsys.readouterr().err


def test_a_prompt_too_long_for_the_model_is_a_clean_error(checkpoint, capsys):
    assert main(["--load", checkpoint[0], "--prompt", "hi", "--max-new-tokens", "120"]) == 2
    assert "--max-new-tokens 120" in capsys.readouterr().err


def test_flags_are_checked(checkpoint, capsys):
    assert main(["--load", checkpoint[0], "--top-p", "2"]) == 2
    assert "--top-p" in capsys.readouterr().err
    # Training's layout flags that a forward pass here has no use for: refused with the reason, not unknown.
    for flag in (["--sequence-parallel"], ["--virtual-pipeline-model-parallel-size", "2"]):
        assert main(["--load", checkpoint[0], "--tensor-model-parallel-size", "2", *flag]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flag[0]} ")
    assert main(["--load", checkpoint[0], "--greedy", "--max-new-token", "3"]) == 2
    assert "did you mean --max-new-tokens" in capsys.readouterr().err


def test_a_training_checkpoint_of_another_layout_samples_without_a_random_state_warning(tmp_path, capsys, recwarn):
    """Found on a first day: the quick start's sample printed a UserWarning that dropout masks would differ from an
    uninterrupted run, because the tp2 x pp2 x dp2 checkpoint's random-number states do not fit one process."""
    from megatron_lite.training.loop import pretrain
    from tests.checkpointing.common import tiny_config

    config = tiny_config(dist_opt=True, iters=1, save=str(tmp_path))  # a layout generation does not run
    config.model.use_fused_kernels = False
    config.data = DataConfig(mock_data=True, tokenizer_type="NullTokenizer")
    pretrain(config)
    recwarn.clear()
    assert main(["--load", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "2"]) == 0
    assert "\n--- sample ---\n1 2 3" in capsys.readouterr().out
    assert not [w for w in recwarn if "random-number states" in str(w.message)]
