import importlib.util
import os

import pytest

from megatron_lite.tokenizer.bpe_trainer import save_gpt2_bpe_files, train_byte_level_bpe
from megatron_lite.tokenizer.sentencepiece_tokenizer import train_sentencepiece
from tools.build_demo_data import demo_documents

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Real text with the cases byte-level tokenizers get wrong: non-ASCII letters, emoji and CJK
# (multi-byte UTF-8), whitespace runs, tabs, CRLF and blank lines, contractions, digits.
TRICKY_TEXT = ("Ünïcödé naïve café — «quotes» ‘single’ 日本語のテキスト 🙂👍🏽\n"
               "  two leading spaces,\ttab\t\tand   runs   of    spaces   \n\n\n"
               "Windows line\r\nend; it's we're they've I'm you'll he'd 'quoted'\n"
               "numbers 3.14159 1,000,000 x²+y²  \u00a0nbsp and \u2003em space\n \n")


@pytest.fixture(scope="session")
def demo_texts():
    """About 460 KB of real English documentation text from the standard library."""
    return demo_documents()


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory, demo_texts):
    """(vocab.json, merges.txt) of a 4,096-entry byte-level BPE trained on the demo text."""
    vocab, merges = train_byte_level_bpe(demo_texts, 4096)
    return save_gpt2_bpe_files(vocab, merges, str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory, demo_texts):
    return train_sentencepiece(demo_texts, str(tmp_path_factory.mktemp("sp") / "tokenizer"), 2048)


@pytest.fixture(scope="session")
def load_tool():
    """Imports tools/<name>.py as a module, so tests call its main(argv) in-process."""
    def load(name):
        spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(REPO_ROOT, "tools", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
