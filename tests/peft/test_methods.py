"""Each method's starting point and its inference forms.

LoRA (B = 0) and adapters (U = 0) start as the base model bit for bit; a prefix changes
attention from the start. A prefix-tuning checkpoint's reparametrising MLP folds into plain
prefixes with the same logits, and an adapter checkpoint loads for generation onto its base.
"""
import dataclasses

import numpy as np
import pytest
import torch

from megatron_lite.checkpointing import read_config
from megatron_lite.data.sft.sft_dataset import build_sample
from megatron_lite.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                                  PeftConfig, TrainingConfig)
from tests.peft.common import load_single_process
from megatron_lite.model.builder import build_model
from megatron_lite.model.document_rows import PackedDocuments
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_lite.training.loop import pretrain
from tools.checkpoint_convert import main as convert

INPUT = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _config(peft: PeftConfig, **checkpoint) -> Config:
    return Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                    seq_length=16, vocab_size=128, normalization="RMSNorm",
                                    position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                                    hidden_dropout=0.0, attention_dropout=0.0),
                  training=TrainingConfig(micro_batch_size=2, train_iters=3), optimizer=OptimizerConfig(lr=1e-2),
                  data=DataConfig(mock_data=True), logging=LoggingConfig(log_memory=False),
                  checkpoint=CheckpointConfig(**checkpoint), peft=peft)


def _logits(config: Config) -> torch.Tensor:
    parallel_state = initialize_model_parallel(1, 1)
    try:
        (model,) = build_model(config, parallel_state)
        with torch.no_grad():
            return model.eval()(INPUT)
    finally:
        destroy_model_parallel(parallel_state)


@pytest.mark.parametrize("peft, starts_as_base", [
    (PeftConfig(peft="lora", lora_rank=4), True), (PeftConfig(peft="adapter", adapter_dim=4), True),
    (PeftConfig(peft="prefix", prefix_length=2), False)], ids=["lora", "adapter", "prefix"])
def test_initial_model(peft, starts_as_base):
    base = _logits(_config(PeftConfig()))
    assert torch.equal(_logits(_config(peft)), base) == starts_as_base


def test_folded_prefix_projection_gives_the_same_logits(tmp_path):
    trained, folded = str(tmp_path / "prefix"), str(tmp_path / "folded")
    peft = PeftConfig(peft="prefix", prefix_length=3, prefix_projection_hidden_size=8)
    pretrain(_config(peft, save=trained))
    assert convert(["--fold-prefix-projection", "--load-dir", trained, "--save-dir", folded]) == 0
    assert read_config(folded).peft == dataclasses.replace(peft, prefix_projection_hidden_size=None)
    model, _ = load_single_process(trained)
    folded_model, _ = load_single_process(folded)
    with torch.no_grad():
        torch.testing.assert_close(folded_model.eval()(INPUT), model.eval()(INPUT), atol=1e-6, rtol=0)
    assert not torch.equal(model(INPUT), _logits(_config(PeftConfig())))


def test_adapter_checkpoint_loads_for_generation_onto_its_base(tmp_path):
    base, adapters = str(tmp_path / "base"), str(tmp_path / "adapters")
    pretrain(_config(PeftConfig(), save=base))
    _, chunks, _ = pretrain(_config(PeftConfig(peft="adapter", adapter_dim=4), pretrained_checkpoint=base,
                                    save=adapters))
    model, config = load_single_process(adapters)
    assert config.peft.peft == "adapter"
    trained = chunks[0].module.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items())
    # load_model stores the matrices column by column for decoding: the same products, summed in another order.
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(INPUT), chunks[0].module.eval()(INPUT), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("peft", [PeftConfig(peft="prefix", prefix_length=3), PeftConfig(peft="lora", lora_rank=4),
                                  PeftConfig(peft="adapter", adapter_dim=4)], ids=["prefix", "lora", "adapter"])
def test_packed_examples_have_their_logits_alone(peft):
    """--sft-pack-sequences: each packed example sees the whole prefix and nothing of its neighbours."""
    examples = [(np.array(ids), np.ones(len(ids), dtype=np.uint8)) for ids in ([5, 6, 7, 8], [9, 10, 11], [12, 13])]
    packed = build_sample(examples, seq_length=12, pad_token=127, pack_sequences=True)
    config = _config(peft)
    parallel_state = initialize_model_parallel(1, 1)
    try:
        (model,) = build_model(config, parallel_state)
        for param in model.parameters():  # every added weight away from its init (LoRA's B and U are zero there)
            torch.nn.init.normal_(param, std=0.2)
        model.eval()
        with torch.no_grad():
            together = model(torch.tensor(packed["tokens"])[None], torch.tensor(packed["position_ids"])[None],
                             PackedDocuments(torch.tensor(packed["document_ids"])[None]))[0]
            offset = 0
            for ids, _ in examples:
                alone = model(torch.tensor(ids[:-1])[None])[0]
                torch.testing.assert_close(together[offset:offset + len(ids) - 1], alone, atol=1e-5, rtol=1e-5)
                offset += len(ids) - 1
    finally:
        destroy_model_parallel(parallel_state)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputation_trains_the_added_weights_alike(granularity):
    """Recomputed layers start from a frozen embedding's output, which needs no gradient: the added
    weights inside must get theirs all the same."""
    peft = PeftConfig(peft="lora", lora_rank=4)
    plain = pretrain(_config(peft))[0].losses
    config = _config(peft)
    config.training.recompute_granularity = granularity
    assert pretrain(config)[0].losses == pytest.approx(plain, rel=1e-6) and plain[0] != plain[-1]


def _generation_model(arch: str, peft: PeftConfig):
    from tests.inference.models import config_of

    parallel_state = initialize_model_parallel(1, 1)
    (model,) = build_model(dataclasses.replace(config_of(arch), peft=peft), parallel_state)
    for param in model.parameters():  # the added weights away from their init (LoRA's B is zero there)
        if param.requires_grad:
            torch.nn.init.normal_(param, std=0.2)
    destroy_model_parallel(parallel_state)
    return model.eval()


@pytest.mark.parametrize("arch", ["rope_gqa", "learned_mha_unfused"])
@pytest.mark.parametrize("peft", [PeftConfig(peft="prefix", prefix_length=3), PeftConfig(peft="lora", lora_rank=4),
                                  PeftConfig(peft="adapter", adapter_dim=4)], ids=["prefix", "lora", "adapter"])
def test_generation_with_the_key_value_cache_and_padding(arch, peft):
    """The cache holds the sequence's own keys, the prefix joins after it; a left-padded batch (an attention
    mask) sees the whole prefix: cached logits equal the full forward's, a padded batch its prompts alone."""
    from megatron_lite.inference.inference_context import StaticInferenceContext
    from megatron_lite.inference.text_generation import generate

    model = _generation_model(arch, peft)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    context = StaticInferenceContext(12)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :5], inference_context=context)]
        context.increment_sequence_len_offset(5)
        for position in range(5, 12):
            steps.append(model(ids[:, position:position + 1], inference_context=context))
            context.increment_sequence_len_offset(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], atol=1e-4, rtol=1e-4)
    prompts = [[5, 17, 3], [40, 2, 9, 71, 8, 66, 12], [31]]
    assert generate(model, prompts, max_new_tokens=6, greedy=True) == [
        generate(model, [prompt], max_new_tokens=6, greedy=True)[0] for prompt in prompts]
