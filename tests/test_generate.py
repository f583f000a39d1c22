"""A checkpoint trained at tp=2 samples text in one process."""
import os
import subprocess
import sys

from megatron_lite.inference.text_generation import generate


def test_generate_cli_from_a_tensor_parallel_checkpoint(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "tools/build_demo_data.py", "--output-dir", str(data)], check=True,
                   capture_output=True)
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(data / "tokenizer/vocab.json"),
                 "--merge-file", str(data / "tokenizer/merges.txt")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                    "megatron_lite.pretrain_gpt", "--tensor-model-parallel-size", "2", "--num-layers", "2",
                    "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                    "--micro-batch-size", "2", "--train-iters", "2", "--data-path", str(data / "demo_text_document"),
                    "--save", str(tmp_path / "ckpt"), "--no-log-memory"] + tokenizer,
                   check=True, capture_output=True, env=env, timeout=300)
    result = subprocess.run([sys.executable, "-m", "megatron_lite.generate", "--load", str(tmp_path / "ckpt"),
                             "--prompt", "The for statement", "--max-new-tokens", "5"] + tokenizer,
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--- sample" in result.stdout and "The for statement" in result.stdout


class _Counting:
    """Stands in for a model: always prefers token (last + 1) mod 7 among the first 7 ids."""

    def __init__(self):
        import torch

        self.param = torch.zeros(1)

    def eval(self):
        return self

    def parameters(self):
        return iter([self.param])

    def __call__(self, context):
        import torch

        logits = torch.full((1, context.shape[1], 10), -10.0)
        logits[0, -1, (int(context[0, -1]) + 1) % 7] = 10.0
        logits[0, -1, 9] = 50.0  # a padding id: must never be sampled
        return logits


def test_greedy_generation_skips_padding_and_stops_at_eod():
    assert generate(_Counting(), [3], max_new_tokens=5, vocab_size=7, seq_length=4, temperature=0) == [4, 5, 6, 0, 1]
    assert generate(_Counting(), [3], max_new_tokens=5, vocab_size=7, seq_length=4, temperature=0, eod=5) == [4, 5]


def test_top_k_zero_samples_from_the_whole_vocabulary():
    import torch

    kwargs = dict(max_new_tokens=3, vocab_size=7, seq_length=4, temperature=1.0)
    top_0 = generate(_Counting(), [3], top_k=0, generator=torch.Generator().manual_seed(0), **kwargs)
    top_none = generate(_Counting(), [3], top_k=None, generator=torch.Generator().manual_seed(0), **kwargs)
    assert top_0 == top_none and len(top_0) == 3
