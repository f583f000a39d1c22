import json
import os

import pytest

CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "<|system|>",
                       "</s>"]
# A zephyr-like template; {% generation %} marks what transformers' return_assistant_tokens_mask reports.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|assistant|>\n' }}{% generation %}"
                 "{{ m['content'] + '</s>\n' }}{% endgeneration %}{% else %}"
                 "{{ '<|' + m['role'] + '|>\n' + m['content'] + '</s>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer.json with chat special tokens and a chat template, built offline."""
    tokenizers = pytest.importorskip("tokenizers")
    directory = str(tmp_path_factory.mktemp("chat_tokenizer"))
    tokenizer = tokenizers.ByteLevelBPETokenizer()
    text = ["hello world, how are you today?", "the answer is 4 and the question was 2 + 2", "be nice and brief"]
    tokenizer.train_from_iterator(text * 20, vocab_size=400, min_frequency=1, special_tokens=CHAT_SPECIAL_TOKENS,
                                  show_progress=False)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
                   "eos_token": "</s>"}, f)
    return directory
