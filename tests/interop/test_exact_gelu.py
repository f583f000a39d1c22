"""The exact (erf) GELU, --gelu-exact: a GPT-2 with activation_function "gelu" imports with transformers' logits
and exports as itself, and Megatron-LM's --no-bias-gelu-fusion (exact GeLU) means the same on our command line.
Megatron-LM's own checkpoint of that kind: tests/interop/test_megatron_import.py."""
import transformers
import torch

from megatron_lite.checkpointing import read_config
from megatron_lite.interop.hf import checkpoint as hf_checkpoint
from megatron_lite.cli.arguments import parse_args
from tests.checkpointing.common import import_hf_model
from tests.interop.test_megatron_import import our_logits
from tools.checkpoint_convert import main as convert

VOCAB = 64
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--vocab-size", "64", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", "1"]


def test_a_gpt2_with_the_exact_gelu_imports_and_exports_as_itself(tmp_path):
    hf_config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=VOCAB,
                                        activation_function="gelu")
    imported = import_hf_model("gpt2", hf_config, tmp_path, vocab=VOCAB)
    assert read_config(imported.root).model.gelu_exact
    logits = our_logits(imported.root, imported.input_ids)[..., :VOCAB]
    torch.testing.assert_close(logits, imported.logits, atol=1e-5, rtol=0)
    # The tanh GELU differs from it where it counts: the same weights read as gelu_new give other logits.
    tanh = transformers.GPT2LMHeadModel.from_pretrained(imported.hf_dir, activation_function="gelu_new").eval()
    with torch.no_grad():
        assert (tanh(imported.input_ids).logits - imported.logits).abs().max() > 1e-4
    assert convert(["--target-format", "hf", "--load-dir", imported.root, "--save-dir", str(tmp_path / "out")]) == 0
    assert hf_checkpoint.read_hf_directory(str(tmp_path / "out"))[0]["activation_function"] == "gelu"


def test_megatrons_no_bias_gelu_fusion_is_the_exact_gelu():
    assert parse_args([*TINY, "--no-bias-gelu-fusion"]).model.gelu_exact
    assert not parse_args(TINY).model.gelu_exact
    # SwiGLU has no GeLU: the flag changes nothing there, in Megatron-LM as here.
    assert not parse_args([*TINY, "--swiglu", "--ffn-hidden-size", "32", "--no-bias-gelu-fusion"]).model.gelu_exact
