"""The tokenizer files of a Hugging Face export, so ``AutoTokenizer`` and ``pipeline(...)`` work on it.

A checkpoint records the tokenizer flags it was trained with (its config's data section).
The export copies those files under the names transformers looks for, writes a
``tokenizer_config.json`` naming the tokenizer class, and returns the special-token ids
that ``config.json`` and ``generation_config.json`` carry. A chat fine-tune's export carries its chat template
(``--sft-tokenizer-prompt-format``: chatml as Jinja, or the tokenizer's own for default), so
``apply_chat_template`` and a chat ``pipeline`` render the text training saw.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from megatron_lite.config import ConfigError
from megatron_lite.data.sft.prompt_format import format_prompt, hf_chat_template
from megatron_lite.tokenizer import build_tokenizer
from megatron_lite.tokenizer.huggingface_tokenizer import saved_chat_template

# (tokenizer class transformers builds, {our flag's field: the file name it expects})
_HF_LAYOUT = {
    "GPT2BPETokenizer": ("GPT2Tokenizer", {"vocab_file": "vocab.json", "merge_file": "merges.txt"}),
    "SentencePieceTokenizer": ("LlamaTokenizer", {"tokenizer_model": "tokenizer.model"}),
    "HuggingFaceTokenizer": ("PreTrainedTokenizerFast", {"tokenizer_model": "tokenizer.json"}),
}
# Conversations on which an exported chat template's ids are compared with training's.
_PROBE_CONVERSATIONS = (
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "Hi there!"}, {"role": "user", "content": " and then, why?\n"}],
)


def export_tokenizer(tokenizer_flags: dict, save_dir: str, *, model_max_length: int,
                     prompt_format: str | None = None) -> dict:
    """Write the tokenizer files into ``save_dir``; returns, for ``config.json`` and ``generation_config.json``,
    the {bos,eos,pad}_token_id each carries (None without a tokenizer).

    ``prompt_format``: the ``--sft-tokenizer-prompt-format`` of a chat fine-tune (None for pretraining)."""
    tokenizer_type = tokenizer_flags.get("tokenizer_type")
    if tokenizer_type not in _HF_LAYOUT:  # mock data, an import, or NullTokenizer: there is none to export
        print(f"note: no tokenizer exported (the checkpoint records {tokenizer_type or 'none'}), so AutoTokenizer "
              f"and pipeline() cannot load {save_dir}: pass --tokenizer-type ({', '.join(_HF_LAYOUT)}) and its "
              f"files to add one.", file=sys.stderr)
        # No special ids either: transformers would default GPT-2's to 50256, outside a smaller vocabulary.
        no_ids = {"bos_token_id": None, "eos_token_id": None}
        return {"config.json": no_ids, "generation_config.json": no_ids}
    tokenizer = build_tokenizer(tokenizer_type, vocab_file=tokenizer_flags.get("vocab_file"),
                                merge_file=tokenizer_flags.get("merge_file"),
                                tokenizer_model=tokenizer_flags.get("tokenizer_model"))
    tokenizer_class, files = _HF_LAYOUT[tokenizer_type]
    for field, name in files.items():
        source = tokenizer_flags[field]
        if os.path.isdir(source):  # HuggingFaceTokenizer also takes the directory of a tokenizer.json
            source = os.path.join(source, name)
        shutil.copyfile(source, os.path.join(save_dir, name))
    chat_template = hf_chat_template(prompt_format, tokenizer) if prompt_format else None
    if tokenizer_type == "HuggingFaceTokenizer":
        tokenizer_config = _hf_tokenizer_files(tokenizer, save_dir, model_max_length, prompt_format, chat_template)
    else:
        tokenizer_config = _tokenizer_config(tokenizer, tokenizer_type, tokenizer_class, model_max_length)
        if chat_template:
            tokenizer_config["chat_template"] = chat_template
    write_json(os.path.join(save_dir, "tokenizer_config.json"), tokenizer_config)
    if prompt_format:
        _check_chat_template(tokenizer, prompt_format, save_dir)
    if tokenizer_type == "HuggingFaceTokenizer":
        return _hf_special_ids(tokenizer)
    bos = tokenizer.bos if tokenizer_type == "SentencePieceTokenizer" else tokenizer.eod
    ids = {"bos_token_id": bos, "eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad}
    return {"config.json": ids, "generation_config.json": ids}


def _tokenizer_config(tokenizer, tokenizer_type: str, tokenizer_class: str, model_max_length: int) -> dict:
    """The tokenizer_config.json of a tokenizer that has none of its own: a SentencePiece model's own special
    pieces (<s>, </s>, <unk>, and a pad where it has one); GPT-2's EOD as every special token, as GPT-2's is."""
    if tokenizer_type == "SentencePieceTokenizer":
        special = tokenizer.special_tokens
    else:
        eos = tokenizer.detokenize([tokenizer.eod])
        special = {"bos_token": eos, "eos_token": eos, "unk_token": eos}
    tokenizer_config = {"tokenizer_class": tokenizer_class, "model_max_length": model_max_length, **special,
                        # ours adds no BOS; without this LlamaTokenizer would prepend one
                        "add_bos_token": False, "add_eos_token": False}
    if tokenizer_type == "SentencePieceTokenizer":
        # transformers prepends "▁" to the text unless told not to; the model itself says whether it
        # does (its add_dummy_prefix), and a leading space then tokenizes like none.
        tokenizer_config["add_prefix_space"] = tokenizer.tokenize("a") == tokenizer.tokenize(" a")
    return tokenizer_config


def _hf_tokenizer_files(tokenizer, save_dir: str, model_max_length: int, prompt_format: str | None,
                        chat_template: str | None) -> dict:
    """A Hugging Face tokenizer's own tokenizer_config.json (returned) and special_tokens_map.json (copied) as
    the source has them, so every special token survives; the chat template is the source's own
    (``chat_template.jinja`` copied too) unless the run was fine-tuned with another, which replaces it, or
    with none (plain), which removes it: apply_chat_template would give text the model never saw."""
    source = tokenizer.directory
    tokenizer_config = _read_json(os.path.join(source, "tokenizer_config.json"))
    if tokenizer_config is None:  # a tokenizer.json whose special tokens only special_tokens_map.json names
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                            **tokenizer.special_tokens}
    kept = [name for name in ("special_tokens_map.json", "chat_template.jinja")
            if os.path.isfile(os.path.join(source, name))]
    if prompt_format == "plain" or (chat_template and chat_template != saved_chat_template(source)):
        tokenizer_config.pop("chat_template", None)
        kept = [name for name in kept if name != "chat_template.jinja"]
        if chat_template:
            tokenizer_config["chat_template"] = chat_template
    for name in kept:
        shutil.copyfile(os.path.join(source, name), os.path.join(save_dir, name))
    return tokenizer_config


def _hf_special_ids(tokenizer) -> dict:
    """The ids ``config.json`` and ``generation_config.json`` carry: the ones the source directory's files
    carry (a model directory's, the usual place of its tokenizer: Qwen's bos_token_id without a bos_token, Llama
    3's list of stop ids), else the tokenizer's own special tokens."""
    own = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eod,
           "pad_token_id": tokenizer.pad if tokenizer.special_tokens.get("pad_token") else None}
    ids = {}
    for name in ("config.json", "generation_config.json"):
        recorded = _read_json(os.path.join(tokenizer.directory, name)) or {}
        ids[name] = {**own, **{key: recorded[key] for key in own if key in recorded}}
    return ids


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _check_chat_template(tokenizer, prompt_format: str, save_dir: str) -> None:
    """Say when ``apply_chat_template`` on the export cannot give the ids training saw.

    Training tokenizes a conversation run by run (``prompt_format``); transformers tokenizes the rendered text
    whole. The two agree where runs meet at pre-token boundaries (a byte-level BPE, or special tokens); a
    SentencePiece model that adds a dummy prefix puts one before every run, so its ids cannot agree."""
    if prompt_format == "plain":
        print(f"note: the run was fine-tuned with --sft-tokenizer-prompt-format plain, which has no chat template: "
              f"apply_chat_template and chat pipelines do not apply to {save_dir}; prompt it with the messages' "
              f"contents back to back, as training saw them.", file=sys.stderr)
        return
    try:
        import transformers
    except ImportError:  # nothing to compare with; the template is written all the same
        return
    theirs = transformers.AutoTokenizer.from_pretrained(save_dir)
    for messages in _PROBE_CONVERSATIONS:
        rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        if list(rendered["input_ids"]) != format_prompt(messages, tokenizer, prompt_format):
            print(f"note: {save_dir}'s chat template ({prompt_format}) renders the text training saw, but its "
                  f"tokenizer gives that text, tokenized whole, other ids than training's turn-by-turn tokenization: "
                  f"apply_chat_template's ids differ from the ones the model was fine-tuned on; give generation the "
                  f"ids of megatron_lite.data.sft.prompt_format.format_prompt instead.", file=sys.stderr)
            return


def import_tokenizer(load_dir: str) -> dict:
    """The ``--tokenizer-*`` flags of the tokenizer files in a Hugging Face directory, for an imported checkpoint
    to record (generation and a later export then need no tokenizer flags); empty when there is none we read.

    Files are looked for in ``_HF_LAYOUT``'s order; one that our tokenizer cannot read (a vocab.json without
    GPT-2's EOD token, say) is passed over: the flags can still name a tokenizer later."""
    for tokenizer_type, (_, files) in _HF_LAYOUT.items():
        paths = {field: os.path.abspath(os.path.join(load_dir, name)) for field, name in files.items()}
        if not all(os.path.isfile(path) for path in paths.values()):
            continue
        try:
            build_tokenizer(tokenizer_type, **paths)
        except (ValueError, ConfigError, OSError, RuntimeError):
            continue
        return {"tokenizer_type": tokenizer_type, **paths}
    return {}


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
