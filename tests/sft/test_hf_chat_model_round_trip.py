"""A Hugging Face chat model's special tokens survive import, --sft on ShareGPT data and export (issue 42, item 1).

Found by a new user: a tiny Qwen3 whose tokenizer's eos_token is <|im_end|> (id 2, no bos, no unk) came back
with eos <|endoftext|>, a bos and an unk it never had and eos/bos id 0 in config.json, and training had ended
every example with <|endoftext|>, so generate with the source's eos_token_id did not stop.
"""
import json
import os

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from megatron_lite.checkpointing import read_config  # noqa: E402
from megatron_lite.data.sft import load_sft_examples  # noqa: E402
from megatron_lite.pretrain_gpt import main as pretrain_main  # noqa: E402
from megatron_lite.tokenizer import build_model_tokenizer  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

# Qwen's ChatML template, as its tokenizer_config.json carries it.
QWEN_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_ID = 2
SHAREGPT = [{"conversations": [{"from": "human", "value": "what is 2 + 2?"}, {"from": "gpt", "value": "4"}]},
            {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hello"},
                               {"from": "gpt", "value": "hello there"}, {"from": "human", "value": "and 3 + 5?"},
                               {"from": "gpt", "value": "8"}]}]


def _qwen3_chat_model(directory: str, *, special_tokens_map: bool) -> None:
    """A tiny Qwen3 and its tokenizer as transformers 5's save_pretrained lays them out
    (tokenizer_config.json, chat_template.jinja), optionally with an older special_tokens_map.json."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["what is 2 + 2? 4 hello there, be brief and 3 + 5 is 8"] * 20, vocab_size=300,
                            min_frequency=1, special_tokens=SPECIAL, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(directory)
    if special_tokens_map:
        with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
            json.dump({"eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>"}, f)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)


def _json(directory, name):
    path = os.path.join(directory, name)
    return json.load(open(path)) if os.path.isfile(path) else None


def _ids(config: dict) -> dict:
    return {key: config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


@pytest.mark.parametrize("special_tokens_map", [False, True], ids=["transformers-5-layout", "special-tokens-map"])
def test_special_tokens_and_ids_survive_fine_tuning_and_export(tmp_path, special_tokens_map):
    source, imported, tuned, exported = (str(tmp_path / n) for n in ("source", "imported", "tuned", "exported"))
    _qwen3_chat_model(source, special_tokens_map=special_tokens_map)
    assert os.path.isfile(os.path.join(source, "chat_template.jinja"))  # transformers 5 keeps it there
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", source,
                    "--save-dir", imported]) == 0
    data = tmp_path / "chat.json"
    data.write_text(json.dumps(SHAREGPT))
    assert pretrain_main(["--sft", "--train-data-path", str(data), "--use-checkpoint-args", "--pretrained-checkpoint",
                          imported, "--micro-batch-size", "2", "--train-iters", "2", "--seq-length", "64",
                          "--eval-iters", "0", "--no-log-memory", "--sft-tokenizer-prompt-format", "default",
                          "--save", tuned]) == 0

    # Training ended each turn and each example with the tokenizer's eos_token, <|im_end|> (id 2).
    recorded = read_config(tuned).data
    tokenizer = build_model_tokenizer(vars(recorded), 1 << 20)
    assert tokenizer.eod == EOS_ID
    examples = load_sft_examples([str(data)], tokenizer, recorded.sft_tokenizer_prompt_format)
    for index in range(len(examples)):
        ids, mask = examples.get(index)
        text = tokenizer.detokenize(ids)
        assert "<|endoftext|>" not in text and text.endswith("<|im_end|>\n"), text
        assert list(ids).count(EOS_ID) == text.count("<|im_end|>")  # no EOD of its own after the template's
        reference = transformers.AutoTokenizer.from_pretrained(source).apply_chat_template(
            [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
             for t in SHAREGPT[index]["conversations"]], tokenize=False)
        assert text == reference

    assert convert(["--source-format", "megatron_lite", "--target-format", "hf", "--load-dir", tuned,
                    "--save-dir", exported]) == 0
    # The tokenizer's files are the source's, special tokens and chat template and all.
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert _json(exported, name) == _json(source, name) if name.endswith(".json") else (
            open(os.path.join(exported, name)).read() == open(os.path.join(source, name)).read()), name
    assert os.path.isfile(os.path.join(exported, "special_tokens_map.json")) == special_tokens_map
    for name in ("config.json", "generation_config.json"):
        assert _ids(_json(exported, name)) == _ids(_json(source, name)), name
    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    assert (theirs.eos_token, theirs.eos_token_id, theirs.bos_token, theirs.unk_token) == ("<|im_end|>", 2, None,
                                                                                         None)
