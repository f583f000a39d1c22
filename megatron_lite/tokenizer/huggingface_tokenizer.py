"""Hugging Face ``tokenizers`` files (``tokenizer.json``); the only place that imports ``tokenizers``, and
``transformers`` for the chat template next to them."""
from __future__ import annotations

import functools
import os

from megatron_lite.config import ConfigError

# End-of-document markers used by common model families, in the order we look for them.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package: "
                          "pip install tokenizers") from None
    return tokenizers


class HuggingFaceTokenizer:
    """``--tokenizer-model`` is a ``tokenizer.json`` or a directory holding one."""

    def __init__(self, tokenizer_model: str):
        path = tokenizer_model
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not path or not os.path.isfile(path):
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model pointing at a "
                              f"tokenizer.json (or its directory); {tokenizer_model!r} has none.")
        self._tokenizer = _import_tokenizers().Tokenizer.from_file(path)
        self._directory = os.path.dirname(os.path.abspath(path))
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        eod = next((vocab[t] for t in _EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise ConfigError(f"{path} has none of the end-of-document tokens {_EOD_CANDIDATES}; add one as a "
                             "special token.")
        self.eod = eod
        self.pad = next((vocab[t] for t in _PAD_CANDIDATES if t in vocab), eod)

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
        return _chat_tokenizer(self._directory).chat_template

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        """The conversation as text by the tokenizer's own chat template (``chat_template`` in the
        ``tokenizer_config.json`` next to ``tokenizer.json``), rendered by transformers."""
        return _chat_tokenizer(self._directory).apply_chat_template(
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
                          "(tokenizer_config.json's chat_template); use --sft-tokenizer-prompt-format chatml or plain.")
    return tokenizer
