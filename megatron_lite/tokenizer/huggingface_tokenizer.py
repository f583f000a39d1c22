"""Hugging Face ``tokenizers`` files (``tokenizer.json``); the only place that imports ``tokenizers``, and
``transformers`` for the chat template next to them."""
from __future__ import annotations

import functools
import json
import os

from megatron_lite.config import ConfigError

# The files beside tokenizer.json that name its special tokens, in the order transformers reads them.
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package: "
                          "pip install tokenizers") from None
    return tokenizers


class HuggingFaceTokenizer:
    """``--tokenizer-model`` is a ``tokenizer.json`` or a directory holding one.

    The end of a document is the tokenizer's own ``eos_token`` (what ``generate`` stops at: ``<|im_end|>`` for
    Qwen's chat models, ``<|eot_id|>`` for Llama 3's), named by the ``tokenizer_config.json`` or
    ``special_tokens_map.json`` beside ``tokenizer.json``; a tokenizer that names none but has a chat template
    ends documents with the token that template writes after an answer."""

    def __init__(self, tokenizer_model: str):
        path = tokenizer_model
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not path or not os.path.isfile(path):
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model pointing at a "
                              f"tokenizer.json (or its directory); {tokenizer_model!r} has none.")
        self._tokenizer = _import_tokenizers().Tokenizer.from_file(path)
        self.directory = os.path.dirname(os.path.abspath(path))
        self.special_tokens = special_tokens(self.directory)
        eos = self.special_tokens.get("eos_token") or self._end_of_turn_token(path)
        self.eod = self._token_id(eos, "eos_token")
        self.bos = self._named_id("bos_token")
        pad = self._named_id("pad_token")
        self.pad = self.eod if pad is None else pad  # padded positions are masked out anyway

    def _named_id(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        return None if token is None else self._token_id(token, role)

    def _token_id(self, token: str, role: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"{self.directory} names {role} {token!r}, which its tokenizer.json does not hold; "
                              f"add it to tokenizer.json's added_tokens or name one it holds.")
        return token_id

    def _end_of_turn_token(self, path: str) -> str:
        """The special token the chat template writes right after an assistant's answer."""
        if saved_chat_template(self.directory):  # read off the files: no transformers import to refuse
            probe = "ANSWER"
            text = self.apply_chat_template([{"role": "user", "content": "question"},
                                             {"role": "assistant", "content": probe}], add_generation_prompt=False)
            after = text[text.rindex(probe) + len(probe):]
            specials = [t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special]
            found = sorted((after.index(t), t) for t in specials if t in after)
            if found:
                return found[0][1]
        raise ConfigError(f"{path} has no end-of-document token: name the tokenizer's eos_token in a "
                          f"tokenizer_config.json beside it ({{\"eos_token\": \"<|endoftext|>\"}}, say).")

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        # Documents are concatenated with explicit EOD tokens; no BOS/EOS template per document.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def chat_template(self) -> str:
        """The Jinja source of the tokenizer's own chat template (what ``apply_chat_template`` renders)."""
        return _chat_tokenizer(self.directory).chat_template

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        """The conversation as text by the tokenizer's own chat template (``chat_template`` in the
        ``tokenizer_config.json`` next to ``tokenizer.json``, or transformers 5's ``chat_template.jinja``),
        rendered by transformers."""
        return _chat_tokenizer(self.directory).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@functools.lru_cache(maxsize=None)
def _chat_tokenizer(directory: str):
    try:
        import transformers
    except ImportError:
        raise ImportError("--sft-tokenizer-prompt-format default renders the tokenizer's chat template with "
                          "transformers: pip install transformers") from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--sft-tokenizer-prompt-format default: the tokenizer in {directory} has no chat template "
                          "(chat_template.jinja, or tokenizer_config.json's chat_template); use "
                          "--sft-tokenizer-prompt-format chatml or plain.")
    return tokenizer


def special_tokens(directory: str) -> dict:
    """``{bos_token, eos_token, pad_token, unk_token: str}`` as the directory's tokenizer files name them
    (``tokenizer_config.json`` first, as transformers reads them); a token they leave out is absent."""
    named = {}
    for name in reversed(SPECIAL_TOKEN_FILES):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as f:
                named.update({role: _token_text(value) for role, value in json.load(f).items()
                              if role in ("bos_token", "eos_token", "pad_token", "unk_token") and value})
    return named


def saved_chat_template(directory: str) -> str | None:
    """The chat template the directory's files hold, as transformers reads it: transformers 5's
    ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("chat_template")


def _token_text(value) -> str:
    # transformers writes a special token as its text, or as an AddedToken's fields {"content": ...}
    return value["content"] if isinstance(value, dict) else value
