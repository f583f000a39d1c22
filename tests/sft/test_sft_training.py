"""Fine-tuning through the training loop: the loss is transformers' cross-entropy over response tokens,
prompts carry no loss or gradient, packing changes nothing, and evaluate measures the same thing."""
import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.checkpointing import read_config
from megatron_lite.config import (CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  TrainingConfig)
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lite.data.sft.sft_dataset import build_sample
from megatron_lite.evaluate import main as evaluate_main
from megatron_lite.model.document_rows import attention_input
from megatron_lite.model.gpt_model import GPTModel
from megatron_lite.pretrain_gpt import main as pretrain_main
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.tensor_parallel import TensorParallelConfig
from megatron_lite.training import loop

transformers = pytest.importorskip("transformers")

from tools.checkpoint_convert import main as convert  # noqa: E402

VOCAB = 100  # NullTokenizer: data ids 0-98, EOD 99
EOD = VOCAB - 1
# (prompt ids, response ids): responses of different lengths, so a per-micro-batch mean would differ.
PAIRS = [([5, 6, 7], [8]), ([9, 10], [11, 12, 13]), ([14, 15, 16, 17], [18, 19]), ([20, 21], [22])]


def _write_jsonl(path, pairs=PAIRS):
    path.write_text("".join(json.dumps({"prompt": " ".join(map(str, p)), "response": " ".join(map(str, r))}) + "\n"
                            for p, r in pairs))
    return str(path)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def imported(request, tmp_path_factory):
    """A small random transformers model saved with save_pretrained and imported with checkpoint_convert."""
    torch.manual_seed(0)
    if request.param == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    hf_dir, ckpt = str(tmp_path_factory.mktemp("hf")), str(tmp_path_factory.mktemp("ckpt"))
    model.save_pretrained(hf_dir)
    assert convert(["--source-format", "hf", "--target-format", "megatron_lite", "--load-dir", hf_dir,
                    "--save-dir", ckpt]) == 0
    return model.eval(), ckpt


def _transformers_response_loss(model, pairs=PAIRS) -> torch.Tensor:
    """Mean cross-entropy over the positions that predict a response token or the EOD, over all examples."""
    total, count = 0.0, 0
    for prompt, response in pairs:
        ids = prompt + response + [EOD]
        logits = model(torch.tensor([ids])).logits[0].double()
        losses = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
        total = total + losses[len(prompt) - 1:].sum()
        count += len(response) + 1
    return total / count


def _transformers_packed_response_loss(model, batch: dict) -> torch.Tensor:
    """The same mean, from one forward of transformers over a packed sample: no attention mask and position ids
    restarting at each example, from which transformers builds its own block-diagonal mask (its packing for
    flash attention, DataCollatorWithFlattening's format; it needs the cache off to look)."""
    logits = model(batch["tokens"], position_ids=batch["position_ids"], use_cache=False).logits.double()
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().double()
    return (losses * mask).sum() / mask.sum()


def _sft_config(ckpt: str, data: str, *, micro_batch_size: int, global_batch_size: int, pack: bool):
    saved = read_config(ckpt)
    return dataclasses.replace(
        saved, model=dataclasses.replace(saved.model, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0),
        training=TrainingConfig(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, train_iters=1),
        # Plain SGD at lr 1: the first update is minus the gradient.
        optimizer=OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                                  lr_decay_style="constant"),
        data=DataConfig(sft=True, train_data_path=[data], tokenizer_type="NullTokenizer", sft_pack_sequences=pack),
        checkpoint=CheckpointConfig(load=ckpt, finetune=True), logging=LoggingConfig(log_memory=False))


@pytest.mark.parametrize("pack", [False, True])
def test_first_iteration_loss_and_gradient_are_transformers_over_response_tokens(imported, tmp_path, pack):
    """Padded: 4 examples in 2 micro-batches, averaged per token over the global batch (not per micro-batch).
    Packed: the 4 examples share one 32-position sequence; loss and gradient are the same, and the loss is also
    transformers' over that packed sequence."""
    model, ckpt = imported
    batch = dict(micro_batch_size=1, global_batch_size=1) if pack else dict(micro_batch_size=2, global_batch_size=4)
    state, chunks, _ = loop.pretrain(_sft_config(ckpt, _write_jsonl(tmp_path / "sft.jsonl"), pack=pack, **batch))
    model.zero_grad()
    expected = _transformers_response_loss(model)
    expected.backward()
    assert state.losses[0] == pytest.approx(expected.item(), rel=1e-5)
    if pack:  # our block-diagonal mask against transformers' own, built from the position ids
        with torch.no_grad():
            packed = _transformers_packed_response_loss(model, _batch(_examples(), pack=True, seq_length=32))
        assert state.losses[0] == pytest.approx(packed.item(), rel=1e-5)
    # The output layer's gradient (the tied embedding's for GPT-2) is the first update, sign flipped.
    ours = dict(chunks[0].module.named_parameters())
    tied = hasattr(model, "transformer")
    name, hf_weight = (("embedding.word_embeddings.weight", model.transformer.wte.weight) if tied
                       else ("output_layer.weight", model.lm_head.weight))
    update = hf_weight.detach() - ours[name].detach()[:VOCAB]
    torch.testing.assert_close(update, hf_weight.grad, rtol=1e-4, atol=1e-6)


def test_sft_command_from_a_pretrained_checkpoint_with_its_args(imported, tmp_path, capsys):
    """The command line users run: the model comes from the imported checkpoint's own settings."""
    model, ckpt = imported
    assert pretrain_main(["--sft", "--pretrained-checkpoint", ckpt, "--use-checkpoint-args", "--seq-length", "32",
                          "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer",
                          "--train-data-path", _write_jsonl(tmp_path / "sft.jsonl"), "--micro-batch-size", "2",
                          "--global-batch-size", "4", "--train-iters", "1", "--log-interval", "1",
                          "--no-log-memory"]) == 0
    logged = float(capsys.readouterr().out.split("| lm loss: ")[1].split()[0])
    with torch.no_grad():
        assert logged == pytest.approx(_transformers_response_loss(model).item(), rel=1e-5)


def test_evaluate_reads_other_formats_through_sft_format_and_data_keys(imported, tmp_path, capsys):
    """An Alpaca JSON array with its own column names measures (and answers) what our JSONL of the same examples
    does, read with the training flags --sft-format and --sft-data-keys."""
    _, ckpt = imported
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"question": " ".join(map(str, p)), "answer": " ".join(map(str, r))}
                                  for p, r in PAIRS]))
    common = ["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--sft", "--exact-match", "--max-new-tokens", "2"]
    assert evaluate_main([*common, "--data-path", _write_jsonl(tmp_path / "sft.jsonl")]) == 0
    ours = capsys.readouterr().out
    assert evaluate_main([*common, "--data-path", str(alpaca), "--sft-format", "alpaca",
                          "--sft-data-keys", "instruction=question", "output=answer"]) == 0
    assert capsys.readouterr().out == ours and "lm loss value: " in ours and "exact match: " in ours
    assert evaluate_main([*common, "--data-path", str(alpaca)]) == 2  # its columns are none of the known names
    assert "rename columns with --sft-data-keys NAME=COLUMN" in capsys.readouterr().err
    assert evaluate_main([*common, "--data-path", str(alpaca), "--sft-data-keys", "question"]) == 2
    assert "--sft-data-keys takes NAME=COLUMN" in capsys.readouterr().err


def test_evaluate_measures_transformers_cross_entropy(imported, tmp_path, capsys):
    """On fine-tuning data (response tokens only) and on an indexed dataset (every token)."""
    model, ckpt = imported
    assert evaluate_main(["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--sft", "--micro-batch-size", "3",
                          "--data-path", _write_jsonl(tmp_path / "sft.jsonl")]) == 0
    out = capsys.readouterr().out
    assert f"loss tokens: {sum(len(r) + 1 for _, r in PAIRS)} |" in out
    with torch.no_grad():
        expected = _transformers_response_loss(model).item()
    assert float(out.split("lm loss value: ")[1].split()[0]) == pytest.approx(expected, rel=1e-5)
    documents = [list(range(1, 40)), list(range(40, 90))]
    with IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), np.uint16) as builder:
        for document in documents:
            builder.add_document(document)
        builder.finalize(str(tmp_path / "corpus.idx"))
    assert evaluate_main(["--load", ckpt, "--tokenizer-type", "NullTokenizer",
                          "--data-path", str(tmp_path / "corpus")]) == 0
    stream, seq_length = sum(documents, []), read_config(ckpt).model.seq_length
    windows = [stream[i:i + seq_length + 1] for i in range(0, len(stream) - seq_length, seq_length)]
    with torch.no_grad():
        losses = [F.cross_entropy(model(torch.tensor([w[:-1]])).logits[0].double(), torch.tensor(w[1:]),
                                  reduction="sum").item() for w in windows]
    out = capsys.readouterr().out
    assert f"loss tokens: {seq_length * len(windows)} |" in out
    assert float(out.split("lm loss value: ")[1].split()[0]) == pytest.approx(sum(losses) / (seq_length * len(windows)),
                                                                            rel=1e-5)


MODELS = {"gpt": dict(), "llama": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                                       add_bias_linear=False, num_query_groups=2,
                                       untie_embeddings_and_output_weights=True)}


def _model(kind: str, parallel_state) -> GPTModel:
    torch.manual_seed(0)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=VOCAB,
                         hidden_dropout=0.0, attention_dropout=0.0, **MODELS[kind])
    model = GPTModel(config, TensorParallelConfig(parallel_state.tensor_model_parallel_group))
    for param in model.parameters():  # biases and norms away from their init, so every weight matters
        torch.nn.init.normal_(param, std=0.1)
    return model


def _examples(pairs=PAIRS):
    return [(np.array(p + r + [EOD]), np.array([0] * len(p) + [1] * (len(r) + 1), dtype=np.uint8)) for p, r in pairs]


def _batch(examples, *, pack: bool, seq_length: int = 24) -> dict:
    samples = [build_sample(examples, seq_length=seq_length, pad_token=EOD, pack_sequences=True)] if pack else [
        build_sample([e], seq_length=seq_length, pad_token=EOD, pack_sequences=False) for e in examples]
    return torch.utils.data.default_collate(samples)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_packed_example_has_the_logits_and_loss_it_has_alone(kind):
    parallel_state = initialize_model_parallel(1, 1)
    model = _model(kind, parallel_state).eval()
    examples = _examples()
    packed, alone = _batch(examples, pack=True), _batch(examples, pack=False)
    with torch.no_grad():
        packed_logits = model(packed["tokens"], packed["position_ids"], attention_input(packed))[0]
        alone_logits = model(alone["tokens"], alone["position_ids"])
        packed_loss = model(packed["tokens"], packed["position_ids"], attention_input(packed),
                            labels=packed["labels"])
        alone_loss = model(alone["tokens"], alone["position_ids"], labels=alone["labels"])
    offset = 0
    for index, (ids, _) in enumerate(examples):
        n = len(ids) - 1
        torch.testing.assert_close(packed_logits[offset:offset + n], alone_logits[index, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_loss[0, offset:offset + n], alone_loss[index, :n], rtol=1e-5, atol=1e-5)
        offset += n
    sums = [loop.loss_func(batch["loss_mask"], loss)[:2]
            for batch, loss in ((packed, packed_loss), (alone, alone_loss))]
    assert sums[0][1] == sums[1][1] == sum(len(r) + 1 for _, r in PAIRS)
    torch.testing.assert_close(sums[0][0], sums[1][0])
    destroy_model_parallel(parallel_state)


def test_prompt_tokens_contribute_no_loss_and_no_gradient():
    parallel_state = initialize_model_parallel(1, 1)
    model = _model("llama", parallel_state)
    batch = _batch(_examples(), pack=False)
    # The mask is 1 exactly where the label is a response token or the EOD after it.
    for row, (prompt, response) in enumerate(PAIRS):
        expected = [0] * (len(prompt) - 1) + [1] * (len(response) + 1)
        assert batch["loss_mask"][row].tolist() == expected + [0] * (24 - len(expected))
        assert batch["labels"][row, len(prompt) - 1:len(prompt) + len(response)].tolist() == response + [EOD]

    def loss_and_grads(labels):
        model.zero_grad()
        loss_sum, _, _ = loop.loss_func(batch["loss_mask"], model(batch["tokens"], batch["position_ids"],
                                                                  labels=labels))
        loss_sum.backward()
        return loss_sum.item(), {name: p.grad.clone() for name, p in model.named_parameters()}

    loss, grads = loss_and_grads(batch["labels"])
    prompt_labels = batch["labels"].clone()
    prompt_labels[batch["loss_mask"] == 0] = torch.randint(0, EOD, (int((batch["loss_mask"] == 0).sum()),))
    other_loss, other_grads = loss_and_grads(prompt_labels)
    assert other_loss == loss
    for name, grad in grads.items():
        torch.testing.assert_close(other_grads[name], grad, rtol=0, atol=0, msg=name)
    response_labels = batch["labels"].clone()
    response_labels[0, len(PAIRS[0][0]) - 1] += 1  # a response label does count
    assert loss_and_grads(response_labels)[0] != loss
    destroy_model_parallel(parallel_state)
