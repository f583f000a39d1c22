"""Packed fine-tuning without an [s, s] mask trains as the block-diagonal mask did.

A packed sample carries each position's document (``document_ids``) and attention runs each document in a row of
its own (``model/document_rows.py``). The reference is the path it replaced: the same samples with their
block-diagonal causal mask [1, s, s] instead (``_with_masks``), through the same trainer (``pretrain``: the data
loader, ``train_step``, the optimizer). Plain SGD without clipping, so the final weights carry every step's
gradients; init std 0.2 and windows, sinks and caps small enough to bite. (Chunked attention takes no mask of the
documents: its chunks restart with each example's positions, which the comparison with the mask proves.) At cp2
(each rank building its rows of the mask from the documents; one layer p2p, one all_gather) against the mask in
one process too.
"""
import json
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.config import (Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                  PeftConfig, TrainingConfig)
from megatron_lite.data.sft import load_sft_examples, preference, sft_dataset
from megatron_lite.model.builder import build_model
from megatron_lite.model.document_rows import DocumentRows, PackedDocuments
from megatron_lite.model.dot_product_attention import DotProductAttention
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.tokenizer import build_tokenizer
from megatron_lite.training.loop import pretrain
from tests.distributed import run_distributed
from tools.preprocess_data import main as preprocess_data

STEPS = 2
SEQ = 40  # no other dimension of the model is 40: a tensor with two of them is [s, s]-sized
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             seq_length=SEQ, vocab_size=64, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
             attention_dropout=0.0, init_method_std=0.2)
MODELS = {"llama": LLAMA,
          "window, global every 2nd layer": dict(LLAMA, window_size=[3, 0], window_attn_skip_freq=2),
          "sinks, soft-capped": dict(LLAMA, softmax_type="learnable", attn_logit_softcapping=2.0),
          "chunked (Llama 4)": dict(LLAMA, attention_chunk_size=4),
          "multi-latent attention": dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=16,
                                         kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=4),
          "multi-token prediction": dict(LLAMA, mtp_num_layers=1),
          "gated DeltaNet, then attention": dict(LLAMA, experimental_attention_variant="gdn",
                                                 linear_attention_freq="[1, 0]", linear_key_head_dim=8,
                                                 linear_value_head_dim=8, linear_num_key_heads=2,
                                                 linear_num_value_heads=4)}


def _random_ids(rng, low, high):
    return " ".join(str(rng.randint(0, 60)) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Chat examples (several per packed sample), the same preprocessed, and preference pairs."""
    root, rng = tmp_path_factory.mktemp("packed"), random.Random(0)
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": _random_ids(rng, 1, 8), "response": _random_ids(rng, 1, 8)}) + "\n"
                            for _ in range(32)))
    assert preprocess_data(["--sft", "--input", str(chat), "--output-prefix", str(root / "chat"),
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]) == 0  # ids 0-62, EOD 63
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": _random_ids(rng, 1, 6), "chosen": _random_ids(rng, 1, 6),
                                         "rejected": _random_ids(rng, 1, 6)}) + "\n" for _ in range(24)))
    return {"jsonl": str(chat), "preprocessed": str(root / "chat"), "pairs": str(pairs)}


def _config(model: dict, data_path: str, *, dpo: bool = False, prefix: bool = False, cp: int = 1,
            recompute: str | None = None) -> Config:
    kind = dict(dpo=True) if dpo else dict(sft=True)
    return Config(model=ModelConfig(**model),
                  parallel=ParallelConfig(context_parallel_size=cp, cp_comm_type=["p2p", "all_gather"]),
                  peft=PeftConfig(peft="prefix", prefix_length=3) if prefix else PeftConfig(),
                  training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=STEPS,
                                          dpo_loss_type="orpo", recompute_granularity=recompute,
                                          recompute_method="uniform" if recompute == "full" else None,
                                          recompute_num_layers=1 if recompute == "full" else None),
                  optimizer=OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.0, lr_decay_style="constant"),
                  data=DataConfig(**kind, train_data_path=[data_path], tokenizer_type="NullTokenizer",
                                  sft_pack_sequences=True),
                  logging=LoggingConfig(log_interval=1, log_memory=False))


def _with_masks(monkeypatch):
    """The data path as it was: each packed sample's block-diagonal causal mask [1, s, s] for its documents (the
    code it had, independent of the model's own ``PackedDocuments.mask``)."""
    build_sample = sft_dataset.build_sample

    def masked(*args, **kwargs):
        sample = build_sample(*args, **kwargs)
        document = sample.pop("document_ids")
        causal = np.tril(np.ones((len(document), len(document)), dtype=bool))
        sample["attention_mask"] = ~(causal & (document[:, None] == document[None, :]))[None]
        return sample
    monkeypatch.setattr(sft_dataset, "build_sample", masked)
    monkeypatch.setattr(preference, "build_sample", masked)


def _train(config, keep_process_group: bool = False):
    state, (model,), _ = pretrain(config, keep_process_group=keep_process_group)
    return state.losses, {name: param.detach().clone() for name, param in model.named_parameters()}


def _train_each(rank, world_size, configs):
    return [_train(config, keep_process_group=True) for config in configs]


def _assert_equal(run, reference):
    (losses, weights), (reference_losses, reference_weights) = run, reference
    assert len(losses) == STEPS and losses[0] != losses[-1]
    torch.testing.assert_close(losses, reference_losses, rtol=1e-5, atol=1e-6)
    for name, weight in weights.items():
        torch.testing.assert_close(weight, reference_weights[name], rtol=1e-5, atol=1e-6, msg=name)


RUNS = {**{model: (model, "jsonl", {}) for model in MODELS}, "prefix tuning": ("llama", "jsonl", dict(prefix=True)),
        "recomputed layers": ("llama", "jsonl", dict(recompute="full")),
        "recomputed cores": ("window, global every 2nd layer", "jsonl", dict(recompute="selective")),
        "preprocessed": ("llama", "preprocessed", {}), "DPO (ORPO)": ("llama", "pairs", dict(dpo=True))}


@pytest.mark.parametrize("run", RUNS)
def test_packed_documents_train_as_the_block_diagonal_mask(data, monkeypatch, run):
    model, source, options = RUNS[run]
    config = _config(MODELS[model], data[source], **options)
    run = _train(config)
    with monkeypatch.context() as patch:
        _with_masks(patch)
        _assert_equal(run, _train(config))


def test_context_parallel_packed_documents_train_as_the_mask_in_one_process(data, monkeypatch):
    models = [MODELS["llama"], MODELS["window, global every 2nd layer"]]
    ranks = run_distributed(_train_each, 2, args=([_config(model, data["jsonl"], cp=2) for model in models],))
    with monkeypatch.context() as patch:
        _with_masks(patch)
        for model, run in zip(models, ranks[0]):
            _assert_equal(run, _train(_config(model, data["jsonl"])))


class _SquareTensors(TorchDispatchMode):
    """Every shape an operation makes with two dimensions of ``size``: the [s, s]-sized ones."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.found = size, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(tensor, torch.Tensor) and list(tensor.shape).count(self.size) >= 2:
                self.found.add((str(func), tuple(tensor.shape)))
        return output


@pytest.mark.parametrize("model", ["llama", "window, global every 2nd layer", "chunked (Llama 4)"])
def test_no_tensor_of_sequence_by_sequence_is_made(data, model):
    """The packed path, a data sample through the forward and backward, makes no [s, s] tensor; the mask it
    replaced does (which shows the check sees one)."""
    config = _config(MODELS[model], data["jsonl"])
    examples = load_sft_examples([data["jsonl"]], build_tokenizer("NullTokenizer", vocab_size=63), "plain")
    sample = sft_dataset.build_sample([examples.get(i) for i in range(4)], seq_length=SEQ, pad_token=0,
                                      pack_sequences=True)
    batch = {key: torch.from_numpy(np.asarray(value))[None] for key, value in sample.items()}
    documents = PackedDocuments(batch["document_ids"])
    assert int(documents.starts().sum()) > 2 and "attention_mask" not in sample
    parallel_state = initialize_model_parallel(1, 1)
    try:
        (model,) = build_model(config, parallel_state)
        found = {}
        for name in ("documents", "mask"):
            with _SquareTensors(SEQ) as mode:  # the mask as the data path made it, and what attention makes of it
                attention = documents if name == "documents" else PackedDocuments(batch["document_ids"]).mask()
                model(batch["tokens"], batch["position_ids"], attention, labels=batch["labels"]).sum().backward()
            found[name] = mode.found
        assert not found["documents"], found["documents"]
        assert found["mask"]
    finally:
        destroy_model_parallel(parallel_state)


@pytest.mark.parametrize("window", [None, [5, 0]])
def test_uneven_documents_fill_rows_of_their_length_and_attend_as_under_the_mask(window):
    """One long document among many short ones: each length group's rows are at most twice its tokens (one row per
    document would be documents x longest), and the core's values and gradients equal the masked path's."""
    lengths = [3, 200, 1, 7, 2, 9, 4, 30, 1, 16, 5, 2]
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    document_ids = torch.stack([document_ids, document_ids.flip(0)])  # the second row: the documents reversed
    documents = PackedDocuments(document_ids)
    buckets = documents.buckets()
    rows = sum(group.num_rows * group.longest for _, group in buckets.groups)
    one_row_each = DocumentRows(documents.starts())  # one row per document, as long as the longest
    assert rows <= 2 * document_ids.numel() < one_row_each.num_rows * one_row_each.longest
    config = ModelConfig(**dict(LLAMA, seq_length=document_ids.shape[1], window_size=window))
    core = DotProductAttention(config, layer_number=0, softmax_scale=0.25, heads_per_group=2)
    torch.manual_seed(0)
    query = torch.randn(document_ids.shape[1], 2, 4, 8, requires_grad=True)
    key, value = (torch.randn(document_ids.shape[1], 2, 2, 8, requires_grad=True) for _ in range(2))
    outputs = []
    causal = torch.ones(document_ids.shape[1], document_ids.shape[1], dtype=torch.bool).tril()
    mask = ~(causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]
    assert torch.equal(mask, documents.mask())
    for attention in (documents, mask):
        output = core(query, key, value, attention)
        output.square().sum().backward()
        outputs.append([output.detach()] + [x.grad.clone() for x in (query, key, value)])
        for x in (query, key, value):
            x.grad = None
    for ours, masked in zip(*outputs):
        torch.testing.assert_close(ours, masked, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="they need its s queries of each of b rows and as many keys"):
        core(query[-1:], key, value, documents)  # a query after cached keys
