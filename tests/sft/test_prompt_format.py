"""Chat templates: which ids the loss covers, and generation prompts that are exactly training's ids."""
import json

import pytest

from megatron_lite.config import SFT_PROMPT_FORMATS, ConfigError
from megatron_lite.data.sft import format_prompt, response_text, tokenize_conversation
from megatron_lite.tokenizer import build_tokenizer
from tests.sft.conftest import CHAT_TEMPLATE

CONVERSATION = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "world"}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "the answer is 4"}]


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer_dir):
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir)


def _masked_text(tokenizer, ids, mask, value):
    return tokenizer.detokenize([i for i, m in zip(ids, mask) if m == value])


def test_plain_prompt_and_response_are_tokenized_separately(tokenizer):
    prompt, response = "the question was", " 2 + 2"
    ids, mask = tokenize_conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                      tokenizer, "plain")
    expected = tokenizer.tokenize(prompt) + tokenizer.tokenize(response) + [tokenizer.eod]
    assert ids.tolist() == expected
    # Loss on exactly the response tokens and the EOD after them.
    assert mask.tolist() == [0] * len(tokenizer.tokenize(prompt)) + [1] * (len(tokenizer.tokenize(response)) + 1)


def test_chatml_loss_covers_the_assistant_turns_only(tokenizer):
    ids, mask = tokenize_conversation(CONVERSATION, tokenizer, "chatml")
    assert tokenizer.detokenize(ids) == (
        "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        "world<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\nthe answer is 4<|im_end|>"
        "</s>")  # the tokenizer's eos_token
    assert _masked_text(tokenizer, ids, mask, 1) == "world<|im_end|>the answer is 4<|im_end|></s>"


def test_the_tokenizers_template_masks_what_transformers_marks_as_assistant(tokenizer, chat_tokenizer_dir):
    """transformers' own return_assistant_tokens_mask (the template's {% generation %} blocks) is the reference."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir).apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tokenize_conversation(CONVERSATION, tokenizer, "default")
    # The template ends each turn with the tokenizer's eos_token (</s>): the example is its text, no EOD added.
    assert tokenizer.detokenize(ids) == tokenizer.detokenize(theirs["input_ids"])
    assert (_masked_text(tokenizer, ids, mask, 1)
            == _masked_text(tokenizer, theirs["input_ids"], theirs["assistant_masks"], 1)
            == "world</s>\nthe answer is 4</s>\n")


@pytest.mark.parametrize("prompt_format", SFT_PROMPT_FORMATS)
def test_generation_prompts_are_the_ids_training_saw(tokenizer, prompt_format):
    ids, mask = tokenize_conversation(CONVERSATION, tokenizer, prompt_format)
    for answer in (2, 4):  # each assistant turn: the prompt is training's ids up to its first response token
        prompt = format_prompt(CONVERSATION[:answer], tokenizer, prompt_format)
        assert prompt == ids[:len(prompt)].tolist()
        assert mask[len(prompt) - 1] == 0 and mask[len(prompt)] == 1


@pytest.mark.parametrize("prompt_format,generated,expected", [
    ("chatml", "the answer is 4<|im_end|>\n<|im_start|>user", "the answer is 4"),
    ("default", "the answer is 4</s>\n<|user|>", "the answer is 4"),
    ("plain", "the answer is 4", "the answer is 4")])
def test_response_text_stops_at_the_end_of_the_turn_or_eod(tokenizer, prompt_format, generated, expected):
    ids = tokenizer.tokenize(generated) + [tokenizer.eod] + tokenizer.tokenize("after the end")
    assert response_text(ids, tokenizer, prompt_format) == expected


def test_the_tokenizers_template_needs_one():
    with pytest.raises(ConfigError, match="--sft-tokenizer-prompt-format default"):
        tokenize_conversation(CONVERSATION, build_tokenizer("NullTokenizer", vocab_size=10), "default")


def test_the_chat_template_is_read_from_either_file(tokenizer, chat_tokenizer_dir, tmp_path):
    """transformers 5's save_pretrained keeps the template in chat_template.jinja, older ones in
    tokenizer_config.json (the fixture's layout): both are the tokenizer's own (issue 42, item 6)."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir).save_pretrained(str(tmp_path))
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    resaved = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert resaved.chat_template == tokenizer.chat_template == CHAT_TEMPLATE
    ours, theirs = (tokenize_conversation(CONVERSATION, t, "default") for t in (tokenizer, resaved))
    assert [a.tolist() for a in ours] == [a.tolist() for a in theirs]
