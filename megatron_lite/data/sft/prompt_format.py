"""Chat templates: a conversation -> token ids, and which of them the fine-tuning loss covers.

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}``; a
``{"prompt", "response"}`` record is the conversation ``[user: prompt, assistant: response]``. A template
renders it as *runs* of text: prompt runs (headers, system and user turns, the opening of the
assistant's turn) and response runs (an assistant's content and its end-of-turn marker). Each run is
tokenized on its own and the ids are concatenated (prompt and response are tokenized separately), so
generation, which tokenizes the prompt runs of the same conversation, is given exactly the ids training saw.

``--sft-tokenizer-prompt-format``:

  plain    the contents back to back, as written: the data carries its own separators;
  chatml   ``<|im_start|>{role}\\n{content}<|im_end|>`` per message, joined by newlines; the prompt ends
           with ``<|im_start|>assistant\\n`` and the response run is ``{content}<|im_end|>``;
  default  the tokenizer's own chat template (a Hugging Face tokenizer's ``chat_template``); runs are the
           differences between the renderings of successive prefixes of the conversation.

A training example ends with EOD after the last (assistant) message, unless the template's end of turn is
the EOD itself (chatml with a tokenizer whose eos_token is ``<|im_end|>``): then the ids are the template's
text as written. The loss covers the response runs and that EOD: exactly the positions whose label is an
assistant token or the EOD closing the example.
"""
from __future__ import annotations

import numpy as np

from megatron_lite.config import ConfigError

ROLES = ("system", "user", "assistant")
CHATML_END_OF_TURN = "<|im_end|>"
# chatml as the Jinja template transformers renders (a Hugging Face export's ``chat_template``): the same text
# as ``_chatml_runs``, joined.
CHATML_JINJA = ("{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
                "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{% if messages %}{{ '\\n' }}{% endif %}"
                "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tokenize_conversation(messages: list[dict], tokenizer, prompt_format: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids ending with EOD, loss mask): the mask is 1 on every response token and the EOD."""
    ids, mask, answer = [], [], []
    for text, is_response in render(messages, tokenizer, prompt_format, add_generation_prompt=False):
        piece = tokenizer.tokenize(text)
        ids += piece
        mask += [is_response] * len(piece)
        answer = piece if is_response else answer
    # A template whose end of turn is the EOD (chatml's <|im_end|>, Qwen's eos_token) closed the example already.
    if tokenizer.eod not in answer:
        ids.append(tokenizer.eod)
        mask.append(True)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def format_prompt(messages: list[dict], tokenizer, prompt_format: str) -> list[int]:
    """The ids a model answers: the conversation so far (ending with a user or system message) and the
    opening of the assistant's turn, tokenized run by run as in training."""
    if messages and messages[-1]["role"] == "assistant":
        raise ValueError("format_prompt takes the conversation before the answer: its last message is the "
                         "assistant's; drop it to generate that answer.")
    runs = render(messages, tokenizer, prompt_format, add_generation_prompt=True)
    return [token for text, _ in runs for token in tokenizer.tokenize(text)]


def response_text(ids, tokenizer, prompt_format: str) -> str:
    """The answer in generated ``ids``: up to the first EOD, and up to the format's end-of-turn marker."""
    ids = [int(i) for i in ids]
    if tokenizer.eod in ids:
        ids = ids[:ids.index(tokenizer.eod)]
    text = tokenizer.detokenize(ids)
    end_of_turn = _end_of_turn(tokenizer, prompt_format)
    return text.split(end_of_turn, 1)[0] if end_of_turn else text


def _end_of_turn(tokenizer, prompt_format: str) -> str:
    """What the format writes after an assistant's content (chatml's <|im_end|>), read off a rendered answer."""
    probe = "ANSWER"
    conversation = [{"role": "user", "content": "question"}, {"role": "assistant", "content": probe}]
    runs = render(conversation, tokenizer, prompt_format, add_generation_prompt=False)
    response = next(text for text, is_response in runs if is_response)
    return response[response.index(probe) + len(probe):].strip()


def render(messages: list[dict], tokenizer, prompt_format: str, *,
           add_generation_prompt: bool) -> list[tuple[str, bool]]:
    """The conversation as runs ``(text, is_response)`` in order, none empty."""
    if prompt_format == "plain":
        runs = [(m["content"], m["role"] == "assistant") for m in messages]
    elif prompt_format == "chatml":
        runs = _chatml_runs(messages, add_generation_prompt)
    elif prompt_format == "default":
        runs = _chat_template_runs(messages, tokenizer, add_generation_prompt)
    else:
        raise ConfigError(f"--sft-tokenizer-prompt-format {prompt_format!r} is not one of plain, chatml, default.")
    return [(text, is_response) for text, is_response in runs if text]


def hf_chat_template(prompt_format: str, tokenizer) -> str | None:
    """The Jinja chat template that renders ``prompt_format``'s text (None for plain, which has none)."""
    if prompt_format == "plain":
        return None
    if prompt_format == "chatml":
        return CHATML_JINJA
    if not hasattr(tokenizer, "chat_template"):  # an export given another tokenizer than the run's
        raise ConfigError(f"the run was fine-tuned with --sft-tokenizer-prompt-format default, the chat template of "
                          f"its Hugging Face tokenizer, which {type(tokenizer).__name__} lacks: export with that "
                          f"tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model), or with none.")
    return tokenizer.chat_template  # default: the tokenizer's own, which training rendered


def _chatml_runs(messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
    runs = []
    for index, message in enumerate(messages):
        # The newline between turns opens the next turn, so an example ends on <|im_end|>, then EOD.
        header = ("\n" if index else "") + f"<|im_start|>{message['role']}\n"
        is_response = message["role"] == "assistant"
        runs += [(header, False), (message["content"] + CHATML_END_OF_TURN, is_response)]
    if add_generation_prompt:
        runs.append((("\n" if messages else "") + "<|im_start|>assistant\n", False))
    return runs


def _chat_template_runs(messages: list[dict], tokenizer, add_generation_prompt: bool) -> list[tuple[str, bool]]:
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        raise ConfigError(f"--sft-tokenizer-prompt-format default uses the tokenizer's own chat template, which "
                          f"only --tokenizer-type HuggingFaceTokenizer has ({type(tokenizer).__name__} has none); "
                          f"use plain or chatml.")
    runs, rendered = [], ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The template's text before the answer (with the assistant's opening) and after it: the answer's
        # run is the difference, which also picks up whatever end-of-turn marker the template writes.
        before = apply(messages[:index], add_generation_prompt=True)
        after = apply(messages[:index + 1], add_generation_prompt=False)
        _check_prefix(rendered, before)
        _check_prefix(before, after)
        runs += [(before[len(rendered):], False), (after[len(before):], True)]
        rendered = after
    full = apply(messages, add_generation_prompt=add_generation_prompt)
    _check_prefix(rendered, full)
    runs.append((full[len(rendered):], False))
    return runs


def _check_prefix(prefix: str, text: str) -> None:
    if not text.startswith(prefix):
        raise ConfigError("the tokenizer's chat template renders a conversation differently once it continues "
                          "(an earlier turn's text changes), so the assistant's tokens cannot be located; use "
                          "--sft-tokenizer-prompt-format chatml or plain.")
