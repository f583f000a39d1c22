"""Context-parallel attention against one process's attention over the whole sequence.

On real gloo groups of 2 and 4 ranks each rank holds its load-balanced chunks of the queries, keys and
values (and of a packed mask's rows); its output and the gradients of its queries, keys and values
must equal the same positions of the whole-sequence core attention (``DotProductAttention``), for both
--cp-comm-type variants and every local kernel: SDPA (the CPU flash kernel under p2p) and the explicit
path, grouped-query heads, a packed block-diagonal mask, a sliding window, a prefix (whose gradient is
the sum over the ranks), attention soft-capping, attention sinks (--softmax-type learnable: joined once to the
ring's log-sum-exp merge, their gradient the sum over the ranks), bf16, and values narrower than keys with a
softmax scale of their own (multi-latent attention's), Llama 4's attention chunks (against the core under
the chunks' mask over the whole sequence: folded, packed, with a prefix and sinks; the ring's block pairs at each
step are those the planner counts); and a whole GPT given this rank's tokens gives the whole sequence's logits
at them.
"""
import dataclasses
import functools
import math
import types

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel import ContextParallelConfig, context_parallel_attention, local_positions
from megatron_lite.context_parallel.sharding import chunk_ids, get_batch_on_this_cp_rank, global_order
from megatron_lite.model.chunked_attention import ChunkedAttention
from megatron_lite.model.document_rows import PackedDocuments
from megatron_lite.model.dot_product_attention import DotProductAttention
from megatron_lite.model.gpt_model import GPTModel
from megatron_lite.model.weight_init import initialize_weights
from megatron_lite.planner.step_time import ring_step_pairs
from megatron_lite.process_groups.parallel_state import mock_parallel_state
from megatron_lite.tensor_parallel import TensorParallelConfig
from megatron_lite.peft.prefix_tuning import KeyValuePrefix
from tests.parity import assert_relative_close

SEQ, BATCH, HEADS, HEAD_DIM = 16, 2, 4, 8

CASES = {
    "causal": {},
    "explicit": dict(attention_backend="unfused"),
    "gqa": dict(num_query_groups=2),
    "gqa-explicit": dict(num_query_groups=2, attention_backend="local"),
    "packed": dict(packed=True),
    "packed-explicit-gqa": dict(packed=True, attention_backend="unfused", num_query_groups=1),
    "window": dict(window_size=[5, 0]),
    "window-packed-explicit": dict(window_size=[3, 0], packed=True, attention_backend="unfused"),
    "prefix": dict(prefix=3),
    "prefix-window-gqa": dict(prefix=2, window_size=[6, 0], num_query_groups=2),
    "softcapping": dict(attn_logit_softcapping=2.0),
    # gpt-oss's sinks, which take the explicit path: with grouped-query heads; with a window, a packed mask and a
    # prefix, where a query may see few keys and the sink most of its attention.
    "sinks-gqa": dict(softmax_type="learnable", num_query_groups=2),
    "sinks-window-packed-prefix": dict(softmax_type="learnable", window_size=[3, 0], packed=True, prefix=2),
    # bf16 against bf16 over the whole sequence: the roundings differ, not the attention.
    "bf16-gqa": dict(num_query_groups=2, bf16=True),
    "bf16-packed-explicit": dict(packed=True, attention_backend="unfused", bf16=True),
    # Multi-latent attention's core: values narrower than keys (which the CPU flash kernel does not take), a
    # softmax scale of its own.
    "narrow-values": dict(value_dim=HEAD_DIM // 2, softmax_scale=0.3),
    "narrow-values-packed-explicit": dict(value_dim=HEAD_DIM // 2, packed=True, attention_backend="unfused"),
    # Llama 4's chunks of 3 and 6 (neither a multiple of a rank's chunk of 4 or 2): folded where positions are
    # known to be the columns, blocked where packed examples restart them (or nothing is known); the ring skips
    # blocks beyond a chunk's reach, and those no query sees.
    "chunks": dict(chunk=3, num_query_groups=2),
    "chunks-not-told": dict(chunk=6, told=False),
    "chunks-explicit-prefix": dict(chunk=6, attention_backend="unfused", prefix=2),
    "chunks-packed": dict(chunk=3, packed=True),
    "chunks-packed-sinks": dict(chunk=6, packed=True, softmax_type="learnable"),
}


def _model_config(case: dict) -> ModelConfig:
    fields = {k: v for k, v in case.items() if k not in ("packed", "prefix", "bf16", "value_dim", "chunk", "told")}
    return ModelConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, seq_length=SEQ,
                       vocab_size=64, attention_dropout=0.0, **fields)


DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])  # of 5, 7 and 4 positions, then 9, 7


def _packed_mask() -> torch.Tensor:
    """Block-diagonal causal [b, 1, s, s] (True = may not attend) of the ``DOCUMENTS``."""
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return ~(causal & (DOCUMENTS[:, :, None] == DOCUMENTS[:, None, :]))[:, None]


def _chunked(attention, case: dict, rows: torch.Tensor | None = None):
    """``attention`` with the case's chunks: the queries' positions (restarting at each packed document) at the
    sequence's ``rows`` (all when None) go with it, or, for the whole sequence's reference, its chunks' mask."""
    if "chunk" not in case:
        return attention
    chunks = ChunkedAttention(case["chunk"])
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    if case.get("packed"):
        positions = torch.tensor([[i - row.index(d) for i, d in enumerate(row)] for row in DOCUMENTS.tolist()])
    if rows is not None:
        columns = not case.get("packed") and case.get("told", True)  # what the model tells: its own positions
        return functools.partial(attention, chunks=chunks, position_ids=positions[:, rows],
                                 positions_are_columns=columns)
    return lambda query, key, value, mask, **kwargs: attention(query, key, value,
                                                               chunks.mask(mask, positions, SEQ), **kwargs)


def _inputs(config: ModelConfig, case: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    groups = config.num_query_groups

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(
            torch.bfloat16 if case.get("bf16") else torch.float32)
    value_dim = case.get("value_dim", HEAD_DIM)
    inputs = {"query": draw(SEQ, BATCH, HEADS, HEAD_DIM), "key": draw(SEQ, BATCH, groups, HEAD_DIM),
              "value": draw(SEQ, BATCH, groups, value_dim), "grad": draw(SEQ, BATCH, HEADS * value_dim)}
    if case.get("packed"):
        inputs["mask"] = _packed_mask()
    if case.get("softmax_type") == "learnable":
        inputs["sinks"] = 2 * draw(HEADS).float()
    return inputs


def _core(config: ModelConfig) -> DotProductAttention:
    """The core attention the layers build for ``config``."""
    return DotProductAttention(config, layer_number=0, softmax_scale=config.softmax_scale or 1 / math.sqrt(HEAD_DIM),
                               heads_per_group=HEADS // config.num_query_groups)


def _prefix(config: ModelConfig, case: dict, seed: int):
    if not case.get("prefix"):
        return None
    prefix = KeyValuePrefix(config, prefix_length=case["prefix"], projection_hidden_size=None, tp_group=None,
                            params_dtype=torch.float32)
    with torch.no_grad():
        prefix.key_value.copy_(torch.randn(prefix.key_value.shape, generator=torch.Generator().manual_seed(seed)))
    return prefix


def _attend(attention, inputs: dict, prefix, positions=None) -> dict:
    """Output and input gradients of ``attention`` at ``positions`` (all of them when None)."""
    pick = (lambda t: t) if positions is None else (lambda t: t.index_select(0, positions))
    leaves = {name: pick(inputs[name]).clone().requires_grad_() for name in ("query", "key", "value")}
    if "sinks" in inputs:
        leaves["sinks"] = inputs["sinks"].clone().requires_grad_()
    mask = inputs.get("mask")
    if mask is not None and positions is not None:
        mask = mask.index_select(2, positions)
    output = attention(leaves["query"], leaves["key"], leaves["value"], mask, prefix=prefix,
                       softmax_offset=leaves.get("sinks"))
    output.backward(pick(inputs["grad"]))
    result = {"output": output.detach(), **{f"grad {name}": leaf.grad for name, leaf in leaves.items()}}
    if prefix is not None:
        result["grad prefix"] = prefix.key_value.grad.clone()
        prefix.key_value.grad = None
    return result


def _compare(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    cp = ContextParallelConfig(cp_group=group, global_ranks=tuple(range(world_size)))
    positions = local_positions(SEQ, rank, world_size)
    checked = []
    for index, (name, case) in enumerate(CASES.items()):
        config = _model_config(case)
        inputs, prefix = _inputs(config, case, seed=index), _prefix(config, case, seed=100 + index)
        expected = _attend(_chunked(_core(config), case), inputs, prefix)
        for comm_type in ("all_gather", "p2p"):
            cp_attention = context_parallel_attention(_core(config),
                                                      ContextParallelConfig(group, cp.global_ranks, (comm_type,)), 0)
            attended = _count_ring_pairs(cp_attention) if comm_type == "p2p" else None
            got = _attend(_chunked(cp_attention, case, positions), inputs, prefix, positions)
            if attended is not None and "chunk" in case and not case.get("packed"):  # as the planner counts them
                model = ModelConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                    seq_length=SEQ, vocab_size=64, position_embedding_type="rope",
                                    attention_chunk_size=case["chunk"])
                assert attended == 2 * ring_step_pairs(model, world_size, 0)[rank], (name, attended)  # both ways
            what, rel = f"cp{world_size} {comm_type} {name}", 3e-2 if case.get("bf16") else 1e-5
            for key, value in got.items():
                assert value.dtype == expected[key].dtype, what
                if key in ("grad prefix", "grad sinks"):  # each rank's queries' share: the whole is the sum
                    dist.all_reduce(value, group=group)
                    assert_relative_close(value, expected[key], what=f"{what} {key}")
                else:
                    assert_relative_close(value, expected[key].index_select(0, positions), rel=rel,
                                          what=f"{what} {key}")
            checked.append(what)
    checked.append(_compare_model_logits(cp, positions))
    return checked


def _count_ring_pairs(ring) -> list[int]:
    """The number of block pairs ``ring`` attends to at each step, forward then backward, as it runs."""
    counts, block_pairs = [], ring.block_pairs

    def counted(*args, **kwargs):
        pairs = list(block_pairs(*args, **kwargs))
        counts.append(len(pairs))
        return iter(pairs)
    ring.block_pairs = counted
    return counts


def _compare_model_logits(cp: ContextParallelConfig, positions: torch.Tensor) -> str:
    """A whole GPT on this rank's tokens, without position ids: its logits are the whole sequence's at them."""
    config = dataclasses.replace(_model_config({"hidden_dropout": 0.0}), num_layers=2)
    whole = GPTModel(config, TensorParallelConfig()).eval()
    initialize_weights([whole], config, mock_parallel_state(0, 1), seed=0)
    model = GPTModel(config, TensorParallelConfig(), context_parallel=cp).eval()
    model.load_state_dict(whole.state_dict())
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    assert_relative_close(model(tokens[:, positions]), whole(tokens)[:, positions], what="logits")
    return "logits"


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_equals_whole_sequence(run_distributed, world_size):
    checked = run_distributed(_compare, world_size)
    assert all(len(c) == 2 * len(CASES) + 1 for c in checked)


def test_chunks_are_load_balanced_and_cover_the_sequence():
    """Rank i holds chunks i and 2cp - 1 - i; together the ranks hold every position once, and causal
    attention gives each rank the same number of (query, key) pairs."""
    for cp in (1, 2, 3, 4):
        held = torch.cat([local_positions(8 * cp, rank, cp) for rank in range(cp)])
        assert sorted(held.tolist()) == list(range(8 * cp))
        assert torch.equal(held[global_order(cp, 4)], torch.arange(8 * cp))
        pairs = {sum(int(p) + 1 for p in local_positions(8 * cp, rank, cp)) for rank in range(cp)}
        assert len(pairs) == 1, pairs
        assert [chunk_ids(rank, cp) for rank in range(cp)] == [(rank, 2 * cp - 1 - rank) for rank in range(cp)]


def test_batch_is_cut_to_the_rank_positions():
    """Every per-position field keeps this rank's positions; a mask its query rows, every key column."""
    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, SEQ), "position_ids": tokens % SEQ,
             "attention_mask": _packed_mask()}
    cut = get_batch_on_this_cp_rank(batch, 1, 2)
    positions = [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    assert cut["tokens"][0].tolist() == positions and cut["labels"][0].tolist() == [p + 1 for p in positions]
    assert cut["position_ids"][1].tolist() == positions
    assert torch.equal(cut["attention_mask"], batch["attention_mask"][:, :, positions, :])
    assert get_batch_on_this_cp_rank(batch, 0, 1) is batch
    # Packed documents stay whole; attention builds this rank's rows of their mask from them.
    documents = dict(batch, document_ids=DOCUMENTS)
    del documents["attention_mask"]
    cut = get_batch_on_this_cp_rank(documents, 1, 2)
    assert cut["document_ids"] is DOCUMENTS
    rows = PackedDocuments(DOCUMENTS).mask(types.SimpleNamespace(rank=1, size=2))  # a ContextParallelConfig's
    assert torch.equal(rows, _packed_mask()[:, :, positions, :])
