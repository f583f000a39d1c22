"""A chat fine-tune's Hugging Face export carries its chat template (issue 22, item 13).

Found by a new-user pass: after `--sft --sft-tokenizer-prompt-format chatml` the export had no chat_template, so
`tokenizer.apply_chat_template` and a chat `pipeline` failed on it.
"""
import json

import pytest

transformers = pytest.importorskip("transformers")

from megatron_lite.data.sft.prompt_format import format_prompt  # noqa: E402
from megatron_lite.pretrain_gpt import main as pretrain  # noqa: E402
from megatron_lite.tokenizer import build_tokenizer  # noqa: E402
from tests.sft.test_prompt_format_kept import CHAT, _run_flags  # noqa: E402
from tools.checkpoint_convert import main as convert  # noqa: E402

PROMPTS = ([{"role": "user", "content": "how are you today?"}],
           [{"role": "system", "content": "be nice"}, {"role": "user", "content": "the question was"},
            {"role": "assistant", "content": "the answer is 4"}, {"role": "user", "content": " and 2 + 2?\n"}])


def _fine_tune_and_export(chat_tokenizer_dir, tmp_path, prompt_format):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    assert pretrain([*_run_flags(chat_tokenizer_dir, str(data)), "--sft-tokenizer-prompt-format", prompt_format,
                     "--train-iters", "1", "--save", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert convert(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(out), "--target-format", "hf"]) == 0
    return out


@pytest.mark.parametrize("prompt_format", ["chatml", "default"])
def test_apply_chat_template_on_the_export_gives_the_ids_training_saw(chat_tokenizer_dir, tmp_path, capsys,
                                                                      prompt_format):
    out = _fine_tune_and_export(chat_tokenizer_dir, tmp_path, prompt_format)
    assert "note:" not in capsys.readouterr().err  # the ids agree, so the export has nothing to warn about
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir)
    for messages in PROMPTS:
        ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert list(ids["input_ids"]) == format_prompt(messages, ours, prompt_format)
    chat = transformers.pipeline("text-generation", model=str(out), device="cpu")
    reply = chat(PROMPTS[0], max_new_tokens=2, do_sample=False)[0]["generated_text"]
    assert reply[:-1] == PROMPTS[0] and reply[-1]["role"] == "assistant"


def test_a_plain_fine_tune_exports_no_template_and_says_so(chat_tokenizer_dir, tmp_path, capsys):
    out = _fine_tune_and_export(chat_tokenizer_dir, tmp_path, "plain")
    assert "--sft-tokenizer-prompt-format plain, which has no chat template" in capsys.readouterr().err
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())


def test_a_tokenizer_whose_ids_cannot_agree_is_named_in_a_note(tmp_path, capsys):
    """A SentencePiece model with a dummy prefix puts "▁" before each separately tokenized run of training's
    prompt, which the same text tokenized whole lacks: apply_chat_template's ids cannot be training's."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from megatron_lite.interop.hf.tokenizer import export_tokenizer
    from tools.build_demo_data import demo_documents
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(demo_documents()[:200]), model_prefix=str(tmp_path / "sp"), vocab_size=400,
        add_dummy_prefix=True, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    out = tmp_path / "hf"
    out.mkdir()
    export_tokenizer({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": str(tmp_path / "sp.model")},
                     str(out), model_max_length=256, prompt_format="chatml")
    assert "tokenized whole, other ids than training's turn-by-turn tokenization" in capsys.readouterr().err
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
