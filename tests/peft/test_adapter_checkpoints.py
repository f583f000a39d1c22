"""Adapter checkpoints: only the trainable weights and a checked pointer to the base; resume and reshard.

A base GPT is trained and saved; a LoRA run fine-tunes it from --pretrained-checkpoint.
Its checkpoints hold the LoRA factors and their Adam state only, name the base
directory and the SHA-256 of its metadata, resume bitwise and under another layout,
and refuse a base that changed, a run without --peft, or other LoRA settings.
"""
import dataclasses
import json
import os

import pytest
import torch

from megatron_lite.checkpointing import storage
from megatron_lite.checkpointing.offline import reshard_checkpoint
from megatron_lite.config import ConfigError, PeftConfig
from megatron_lite.training.loop import build_optimizer_and_scheduler, get_model, pretrain
from megatron_lite.process_groups.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.checkpointing.common import tiny_config
from tests.distributed import run_distributed

LORA = dict(peft="lora", lora_rank=4, lora_alpha=16.0, lora_target_modules=["linear_qkv", "linear_fc1", "linear_fc2"])


def _config(peft: dict | None = LORA, **kwargs):
    config = tiny_config(**kwargs)
    return dataclasses.replace(config, peft=PeftConfig(**peft)) if peft else config


def _metadata(root: str) -> dict:
    return storage.read_metadata(storage.resolve_checkpoint_dir(root))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("base"))
    pretrain(_config(None, iters=2, save=root))
    return root


def _state(config):
    state, chunks, _ = pretrain(config)
    return state, chunks


def test_adapter_checkpoint_holds_only_adapters_and_resumes_bitwise(base, tmp_path):
    adapters = str(tmp_path / "adapters")
    uninterrupted, chunks = _state(_config(iters=4, pretrained_checkpoint=base))
    stopped, _ = _state(_config(iters=4, pretrained_checkpoint=base, save=adapters, exit_interval=2))
    resumed, _ = _state(_config(iters=4, pretrained_checkpoint=base, load=adapters))
    assert stopped.losses == uninterrupted.losses[:2] and resumed.losses == uninterrupted.losses

    metadata = _metadata(adapters)
    trainable = {name for name, p in chunks[0].module.named_parameters() if p.requires_grad}
    weights = {k for k in metadata["tensors"] if not k.startswith("optimizer.")}
    assert weights == trainable and all(".lora.lora_" in k for k in weights)
    assert {k.split(".", 2)[2] for k in metadata["tensors"] if k.startswith("optimizer.")} == trainable
    base_dir = storage.resolve_checkpoint_dir(base)
    assert metadata["training_state"]["peft_base"] == {
        "directory": os.path.abspath(base_dir), "iteration": 2,
        "metadata_sha256": storage.sha256_file(os.path.join(base_dir, "metadata.json"))}
    adapter_bytes = sum(f["size"] for f in metadata["files"].values())
    base_bytes = sum(f["size"] for f in _metadata(base)["files"].values())
    assert adapter_bytes < base_bytes / 3, (adapter_bytes, base_bytes)


def test_frozen_base_is_the_base_checkpoint_and_holds_no_optimizer_memory(base):
    """The base weights equal the checkpoint's after fine-tuning; gradient buffers and Adam state cover
    the LoRA factors only (4 bytes of gradient and 8 of Adam moments per trainable fp32 parameter,
    measured by the memory report)."""
    config = _config(iters=2, pretrained_checkpoint=base)
    _, chunks = _state(config)
    trained = dict(chunks[0].module.named_parameters())
    loaded = _load_weights(_config(None, load=base, finetune=True))
    frozen = [name for name, p in trained.items() if not p.requires_grad]
    assert frozen and all(torch.equal(trained[name], loaded[name]) for name in frozen)

    parallel_state = initialize_model_parallel(1, 1)
    try:
        report, full_report = (build_optimizer_and_scheduler(c, parallel_state, get_model(c, parallel_state))[0]
                               .memory_report() for c in (config, _config(None)))
    finally:
        destroy_model_parallel(parallel_state)
    trainable = sum(p.numel() for p in trained.values() if p.requires_grad)
    total = sum(p.numel() for p in trained.values())
    assert report["gradient_bytes"] == 4 * trainable and report["optimizer_state_bytes"] == 8 * trainable
    assert report["parameter_bytes"] == 4 * total
    assert full_report["gradient_bytes"] == 4 * (total - trainable)  # full fine-tuning: every base weight


def _load_weights(config) -> dict:
    from megatron_lite.checkpointing import load_checkpoint

    parallel_state = initialize_model_parallel(1, 1)
    try:
        chunks = get_model(config, parallel_state)
        load_checkpoint(config, parallel_state, chunks, None, None)
    finally:
        destroy_model_parallel(parallel_state)
    return {name: p.detach() for name, p in chunks[0].module.named_parameters()}


def _resume_elsewhere(rank, world_size, kwargs):
    state, _, _ = pretrain(_config(**kwargs))
    return state.losses or None


def _resume_each_elsewhere(rank, world_size, runs):
    """``_resume_elsewhere`` for each run in turn, in one world."""
    return [_resume_elsewhere(rank, world_size, kwargs) for kwargs in runs]


def test_adapter_checkpoint_reshards(base, tmp_path):
    """Saved at (1, 1, 1), resumed at tensor 2 x pipeline 2 with the distributed optimizer, and rewritten
    by the converter for that layout: the losses continue those of the uninterrupted run."""
    adapters, converted = str(tmp_path / "adapters"), str(tmp_path / "converted")
    uninterrupted, _ = _state(_config(iters=4, pretrained_checkpoint=base))
    _state(_config(iters=4, pretrained_checkpoint=base, save=adapters, exit_interval=2))
    reshard_checkpoint(adapters, converted, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert _metadata(converted)["training_state"]["peft_base"] == _metadata(adapters)["training_state"]["peft_base"]
    assert {k for k in _metadata(converted)["tensors"]} == {k for k in _metadata(adapters)["tensors"]}
    loads = (adapters, converted)
    per_rank = run_distributed(_resume_each_elsewhere, 8, args=(
        [dict(tp=2, pp=2, dist_opt=True, iters=4, load=load, global_batch=8) for load in loads],), timeout=300)
    for index in range(len(loads)):
        losses = [r[index] for r in per_rank if r[index] is not None]
        assert losses
        for rank_losses in losses:
            assert rank_losses[:2] == uninterrupted.losses[:2]
            assert rank_losses[2:] == pytest.approx(uninterrupted.losses[2:], rel=1e-5)


def test_adapter_checkpoint_under_zero3(base, tmp_path):
    """LoRA under ZeRO-3 at dp 2: the frozen base (not sharded) loads whole and is not written, each
    rank writes the slices of the adapters its shard holds, and the run resumes bitwise at dp 2 and
    continues in one process."""
    adapters = str(tmp_path / "adapters")
    zero3 = dict(strategy="optim_grads_params", iters=4, pretrained_checkpoint=base)

    def losses(**kwargs):
        reported = [r for r in run_distributed(_resume_elsewhere, 2, args=(dict(zero3, **kwargs),)) if r is not None]
        assert reported and all(r == reported[0] for r in reported)
        return reported[0]

    uninterrupted = losses()
    assert losses(save=adapters, exit_interval=2) == uninterrupted[:2]
    assert losses(load=adapters) == uninterrupted
    tensors = _metadata(adapters)["tensors"]
    weights = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    assert weights and all(".lora.lora_" in k for k in weights)
    files = {shard["file"] for entry in weights.values() for shard in entry["shards"]}
    assert files == {storage.rank_file_name(0), storage.rank_file_name(1)}
    assert all(shard["flat_range"] is not None for entry in weights.values() for shard in entry["shards"])
    one_process, _ = _state(_config(iters=4, pretrained_checkpoint=base, load=adapters))
    assert one_process.losses[:2] == uninterrupted[:2]
    assert one_process.losses[2:] == pytest.approx(uninterrupted[2:], rel=1e-5)


def test_changed_base_other_settings_and_plain_runs_are_refused(base, tmp_path):
    root = str(tmp_path / "base_copy")
    pretrain(_config(None, iters=2, save=root))
    adapters = str(tmp_path / "adapters")
    pretrain(_config(iters=2, pretrained_checkpoint=root, save=adapters))

    with pytest.raises(ConfigError, match="--lora-rank: checkpoint 4, this run 8"):
        pretrain(_config(dict(LORA, lora_rank=8), iters=3, load=adapters))
    with pytest.raises(ConfigError, match="adapter checkpoint .*--peft lora"):
        pretrain(_config(None, iters=3, load=adapters))

    metadata_path = os.path.join(storage.resolve_checkpoint_dir(root), "metadata.json")
    with open(metadata_path) as f:
        metadata = json.load(f)
    metadata["iteration"] = 3
    with open(metadata_path, "w") as f:
        json.dump(metadata, f)
    with pytest.raises(storage.CheckpointError, match="not the one the adapters .* were trained on"):
        pretrain(_config(iters=3, load=adapters))


def test_use_checkpoint_args_takes_the_peft_settings(base, tmp_path):
    from megatron_lite.cli.arguments import parse_args

    adapters = str(tmp_path / "adapters")
    pretrain(_config(iters=2, pretrained_checkpoint=base, save=adapters))
    config = parse_args(["--load", adapters, "--use-checkpoint-args", "--mock-data", "--peft", "lora",
                         "--lora-dropout", "0.1"])
    assert config.peft == PeftConfig(**{**LORA, "lora_dropout": 0.1})
    assert parse_args(["--load", base, "--use-checkpoint-args", "--mock-data"]).peft == PeftConfig()
    # A contradicting setting is refused at once, not later with advice to add the flag already given.
    with pytest.raises(ConfigError, match="(?s)contradict it:\n  --lora-rank: checkpoint 4, this run 8\nDrop them"):
        parse_args(["--load", adapters, "--use-checkpoint-args", "--mock-data", "--peft", "lora", "--lora-rank", "8",
                    "--lora-alpha", "16"])


def test_random_base_is_recorded_by_seed(tmp_path):
    adapters = str(tmp_path / "adapters")
    uninterrupted, _ = _state(_config(iters=3))
    _state(_config(iters=3, save=adapters, exit_interval=2))
    assert _metadata(adapters)["training_state"]["peft_base"] == {"init_seed": 1234, "init_method_std": 0.02}
    resumed, _ = _state(_config(iters=3, load=adapters))
    assert resumed.losses == uninterrupted.losses
    config = _config(iters=3, load=adapters)
    config.training.seed = 7
    with pytest.raises(ConfigError, match="--seed 1234"):
        pretrain(config)
