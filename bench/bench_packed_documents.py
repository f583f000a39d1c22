"""Packed fine-tuning on CPU: one packed sample's forward and backward, documents in rows of their own against the
block-diagonal mask they replaced.

A tiny-width model (2 layers, hidden 64, 4 heads of 16 in 2 key/value groups, SwiGLU, vocabulary 256; fp32) takes
one packed sample of ``s`` positions: examples of 64-1024 tokens (a fixed random draw), or with ``/uneven`` one
of s/2 tokens and then examples of 64, filled in by ``build_sample``; the sample is collated and goes forward
and backward through the model, two ways:

- "block-diagonal mask": the sample carries its mask, bool [1, s, s], built in the data path as this code did
  before (``_sample_with_mask`` below is that code), and attention reads it;
- "documents": the sample as it is (``document_ids``), attention on each document's row
  (``model/document_rows.py``).

Each side runs in a fresh process (``side_by_side.Contender``, one thread). Memory is what the first sample's
build, forward and backward add to the process's peak resident memory (after a short warm-up step), and the
activations autograd keeps for the backward at their peak (``harness.SavedActivationPeak``); time is the CPU time
of the sample's build, forward and backward, per round, the sides alternating.

    python bench/bench_packed_documents.py [--cases 4096 8192 8192/uneven] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.side_by_side import alternate_builds, load_average, markdown_table  # noqa: E402

MB = 2 ** 20
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
             vocab_size=256, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)


def _examples(seq: int, uneven: bool) -> list:
    """Examples of 64-1024 ids (a fixed draw), or one of seq/2 and then 64 each, as many as fill ``seq``
    positions; loss on their second half."""
    import numpy as np

    rng, examples, filled = np.random.RandomState(0), [], 0
    while True:
        length = (seq // 2 if not examples else 64) if uneven else int(rng.randint(64, 1025))
        if filled + length - 1 > seq:
            return examples
        mask = np.zeros(length, dtype=np.uint8)
        mask[length // 2:] = 1
        examples.append((rng.randint(0, 255, size=length).astype(np.int64), mask))
        filled += length - 1


def _sample_with_mask(examples: list, seq: int) -> dict:
    """The data path before: the sample's block-diagonal causal mask [1, s, s] instead of its documents."""
    import numpy as np

    from megatron_lite.data.sft.sft_dataset import build_sample

    sample = build_sample(examples, seq_length=seq, pad_token=0, pack_sequences=True)
    document = sample.pop("document_ids")
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    sample["attention_mask"] = ~(causal & (document[:, None] == document[None, :]))[None]
    return sample


def build(seq: int, uneven: bool, with_mask: bool):
    """The model and its sample's examples; one build, forward and backward measured; a callable that runs another."""
    import torch

    from bench.harness import first_step_memory
    from megatron_lite.config import ModelConfig
    from megatron_lite.data.sft.sft_dataset import build_sample
    from megatron_lite.model.document_rows import attention_input
    from megatron_lite.model.gpt_model import GPTModel
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.tensor_parallel import TensorParallelConfig

    initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**MODEL, seq_length=seq), TensorParallelConfig())

    def step(length: int = seq):
        examples = _examples(length, uneven)
        sample = (_sample_with_mask(examples, length) if with_mask else
                  build_sample(examples, seq_length=length, pad_token=0, pack_sequences=True))
        batch = torch.utils.data.default_collate([sample])
        loss = model(batch["tokens"], batch["position_ids"], attention_input(batch), labels=batch["labels"])
        (loss * batch["loss_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)

    return step, first_step_memory(step, 256, list(model.parameters())) | {"documents": len(_examples(seq, uneven))}


def compare(seq: int, uneven: bool, rounds: int) -> list:
    sides = {"block-diagonal mask": True, "documents": False}
    seconds, info = alternate_builds(build, sides, rounds, seq, uneven)
    kind = f"{info['documents']['documents']}" + (", one of s/2, the others 64" if uneven else "")
    return [[str(seq), kind, name, f"{info[name]['peak_added'] / MB:.0f}", f"{info[name]['saved'] / MB:.0f}",
             f"{statistics.median(s.cpu for s in seconds[name]):.2f}"] for name in sides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["4096", "8192", "8192/uneven"],
                        help="SEQ, or SEQ/uneven for one example of SEQ/2 tokens among examples of 64")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per case (the median counts)")
    args = parser.parse_args(argv)
    rows = []
    for case in args.cases:
        seq, *uneven = case.split("/")
        rows += compare(int(seq), uneven == ["uneven"], args.rounds)
    print(f"packed sample, 2 layers, hidden 64, 4 heads (2 groups), fp32, one thread each; {load_average()}")
    print(markdown_table(["s", "examples", "attention", "peak memory added (MB)", "kept for backward (MB)",
                          "build + forward + backward, CPU (s)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
