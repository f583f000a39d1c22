"""Llama 4's chunked attention on CPU: a chunked layer's forward and backward, chunk by chunk against one mask
over the whole sequence.

One transformer layer with chunked attention (hidden 512, 8 heads of 64 in 2 key/value groups, q/k L2 norms,
a dense SwiGLU MLP 1024 wide; fp32, one sequence) runs forward and backward two ways:

- "whole-sequence mask": the core attention under one [b, 1, s, s] mask of each query's chunk, as this code did
  before attending chunk by chunk (``WholeSequenceMask`` below is that code);
- "chunk by chunk": the layer as it is (``model/chunked_attention.py``): folded into the batch for unpacked rows,
  query blocks against their chunks' keys for packed ones.

Each side runs in a fresh process (``side_by_side.Contender``, one thread). Memory is what the first forward and
backward adds to the process's peak resident memory (the step's transient tensors: masks, scores, gradients;
after a short warm-up step),
and the activations autograd keeps for the backward at their peak (``harness.SavedActivationPeak``); time is the
CPU time of a forward and backward, per round, the sides alternating.

    python bench/bench_chunked_attention.py [--cases 4096/1024 8192/1024 16384/8192 8192/1024/packed] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.side_by_side import alternate_builds, load_average, markdown_table  # noqa: E402

MB = 2 ** 20
LAYER = dict(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1024,
             vocab_size=256, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             position_embedding_type="rope", qk_l2_norm=True, hidden_dropout=0.0, attention_dropout=0.0)


def build(seq: int, chunk: int, packed: bool, whole_sequence_mask: bool):
    """The layer and its inputs; one forward and backward measured; a callable that runs another."""
    import torch

    from bench.harness import first_step_memory
    from megatron_lite.config import ModelConfig
    from megatron_lite.model.chunked_attention import ChunkedAttention
    from megatron_lite.model.embedding import rotary_freqs
    from megatron_lite.model.transformer_layer import TransformerLayer
    from megatron_lite.process_groups.parallel_state import initialize_model_parallel
    from megatron_lite.tensor_parallel import TensorParallelConfig

    class WholeSequenceMask(ChunkedAttention):
        """Before attending chunk by chunk: past one chunk, the core under one mask over the whole sequence."""

        def __call__(self, core_attention, query, key, value, attention_mask, position_ids, **_):
            if key.shape[0] > self.chunk_size:
                attention_mask = self.mask(attention_mask, position_ids, key.shape[0])
            return core_attention(query, key, value, attention_mask)

    config = ModelConfig(**LAYER, seq_length=seq, attention_chunk_size=chunk)
    initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    layer = TransformerLayer(config, layer_number=0, tp_config=TensorParallelConfig())
    if whole_sequence_mask:
        layer.self_attention.chunks = WholeSequenceMask(chunk)
    hidden = torch.randn(seq, 1, config.hidden_size, requires_grad=True)
    positions, mask = torch.arange(seq)[None], None
    if packed:  # two documents, the second starting mid-chunk, each counting its own chunks
        split = seq // 2 + chunk // 3
        positions = torch.cat([torch.arange(split), torch.arange(seq - split)])[None]
        document = torch.arange(seq) >= split
        mask = ((document[:, None] != document[None, :]) | torch.ones(seq, seq, dtype=torch.bool).triu(1))[None, None]
    freqs = rotary_freqs(positions, config.head_dim, config.rotary_base)

    def step(length: int = seq):
        cut_mask = None if mask is None else mask[..., :length, :length]
        # As the model tells its layers: an unpacked sequence's positions are its columns (the fold's case).
        layer(hidden[:length], freqs[:length], cut_mask, positions[:, :length],
              positions_are_columns=not packed).square().mean().backward()
        layer.zero_grad(set_to_none=True)
        hidden.grad = None

    return step, first_step_memory(step, 64, list(layer.parameters()) + [hidden])


def compare(seq: int, chunk: int, packed: bool, rounds: int) -> list:
    sides = {"whole-sequence mask": True, "chunk by chunk": False}
    seconds, info = alternate_builds(build, sides, rounds, seq, chunk, packed)
    kind = "packed, 2 documents" if packed else "one sequence"
    return [[f"{seq} / {chunk}", kind, name, f"{info[name]['peak_added'] / MB:.0f}",
             f"{info[name]['saved'] / MB:.0f}", f"{statistics.median(s.cpu for s in seconds[name]):.2f}"]
            for name in sides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["4096/1024", "8192/1024", "16384/8192", "8192/1024/packed"],
                        help="SEQ/CHUNK, or SEQ/CHUNK/packed for two packed documents")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per case (the median counts)")
    args = parser.parse_args(argv)
    rows = []
    for case in args.cases:
        seq, chunk, *packed = case.split("/")
        rows += compare(int(seq), int(chunk), packed == ["packed"], args.rounds)
    print(f"chunked layer, hidden 512, 8 heads (2 groups), fp32, one thread each; {load_average()}")
    print(markdown_table(["s / C", "input", "attention", "peak memory added (MB)", "kept for backward (MB)",
                          "forward + backward, CPU (s)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
