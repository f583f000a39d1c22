"""--deepspeed-config: DeepSpeed's JSON becomes our own flags. LLaMA-Factory's shipped shapes and DeepSpeed's
documented keys translate and train with the losses of the equivalent flags; the batch triad is checked as
DeepSpeed checks it; unsupported keys and keys contradicting a flag are one error each."""
import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.cli.arguments import parse_args
from megatron_lite.cli.deepspeed_config import translate
from megatron_lite.optimizer.optimizer_param_scheduler import get_optimizer_param_scheduler
from megatron_lite.training.loop import pretrain

CONFIGS = os.path.join(os.path.dirname(__file__), "deepspeed_configs")
MODEL = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads",
         "2", "--seq-length", "8", "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--no-log-memory", "--log-interval", "1", "--eval-iters", "0", "--seed", "7"]
FP16_SCALER = {"loss_scale": None, "loss_scale_window": 1000, "initial_loss_scale": 65536.0, "hysteresis": 2,
               "min_loss_scale": 1.0}  # every LLaMA-Factory file's fp16 block (enabled "auto")


def _config(name: str) -> dict:
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("name, expected", [
    ("ds_z0_config.json", {"data_parallel_sharding_strategy": "no_shard", "overlap_grad_reduce": False,
                           "ddp_bucket_size": 500000000}),
    ("ds_z2_config.json", {"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": False,
                           "ddp_bucket_size": 500000000}),
    ("ds_z3_config.json", {"data_parallel_sharding_strategy": "optim_grads_params", "overlap_grad_reduce": False}),
    ("ds_z3_offload_config.json", {"data_parallel_sharding_strategy": "optim_grads_params",
                                   "overlap_grad_reduce": False, "optimizer_cpu_offload": True,
                                   "grad_cpu_offload": True}),
])
def test_llama_factory_files_translate_to_our_flags(name, expected):
    fields, ignored, _ = translate(_config(name), {}, world_size=2)
    assert fields == {**expected, **FP16_SCALER}  # every "auto" is left to the command line
    assert "zero_optimization.stage3_max_live_parameters" in ignored or name in ("ds_z0_config.json",
                                                                                   "ds_z2_config.json")
    assert all("offload_param" not in key for key in ignored) or name == "ds_z3_offload_config.json"


@pytest.mark.parametrize("keys, explicit, world_size, batch", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, {}, 2, (2, 16)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, {}, 2, (2, 16)),  # accumulation 4 derived
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, {}, 2, (4, 16)),  # micro derived
    ({"train_batch_size": 8}, {}, 4, (2, 8)),  # DeepSpeed: micro = train / world, no accumulation
    ({"train_micro_batch_size_per_gpu": 3}, {}, 2, (3, 6)),
    ({"gradient_accumulation_steps": 2, "train_batch_size": "auto"}, {"micro_batch_size": 2}, 2, (2, 8)),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"}, {"micro_batch_size": 2,
                                                                          "tensor_model_parallel_size": 2}, 4, (2, 8)),
    ({"train_batch_size": 8}, {"context_parallel_size": 2}, 4, (4, 8)),  # context ranks share micro-batches
])
def test_the_batch_triad_is_completed_as_deepspeed_does(keys, explicit, world_size, batch):
    fields, _, _ = translate(keys, explicit, world_size)
    assert (fields["micro_batch_size"], fields["global_batch_size"]) == batch


def test_the_monitors_become_our_loggers():
    config = {"tensorboard": {"enabled": True, "output_path": "logs", "job_name": "bert"},
              "wandb": {"enabled": True, "project": "p", "team": "t"}, "csv_monitor": {"enabled": False}}
    assert translate(config, {}, 1)[0] == {"tensorboard_dir": os.path.join("logs", "bert"), "wandb_project": "p",
                                           "wandb_entity": "t"}
    with pytest.raises(ConfigError, match="does not implement wandb.group; csv_monitor"):
        translate({"wandb": {"enabled": True, "project": "p", "group": "g"}, "csv_monitor": {"enabled": True}}, {}, 1)


def test_a_batch_triad_that_does_not_add_up_is_one_error():
    with pytest.raises(ConfigError, match=r"train_batch_size \(32\) must equal train_micro_batch_size_per_gpu \(2\) "
                                          r"x gradient_accumulation_steps \(4\) x data-parallel size \(2"):
        translate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
                  {}, 2)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps \(None\)"):
        translate({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, {}, 2)


def test_unsupported_keys_are_listed_in_one_error():
    config = {**_config("ds_z2_config.json"), "activation_checkpointing": {"partition_activations": True},
              "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "exp"}}}
    config["zero_optimization"] = {**config["zero_optimization"], "offload_optimizer": {"device": "nvme"}}
    with pytest.raises(ConfigError) as raised:
        translate(config, {}, 2, source="ds.json")
    message = str(raised.value)
    assert message.startswith("--deepspeed-config ds.json: megatron_lite does not implement ")
    for part in ("activation_checkpointing", "optimizer.type Lamb (only Adam and AdamW)",
                 "zero_optimization.offload_optimizer.device nvme (only cpu)",
                 "scheduler.params.warmup_type exp (only linear and log)"):
        assert part in message


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "abc"}},
     'zero_optimization.reduce_bucket_size is "abc"; expected an integer'),
    ({"gradient_clipping": [1]}, "gradient_clipping is [1]; expected a number"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu is 2.5; expected an integer"),
    ({"fp16": {"enabled": "yes"}}, 'fp16.enabled is "yes"; expected true or false'),
    ({"fp16": {"enabled": True, "initial_scale_power": "16"}}, 'fp16.initial_scale_power is "16"; expected an integer'),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, "x"]}}},
     'optimizer.params.betas[1] is "x"; expected a number'),
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas is 0.9; expected two numbers"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": True}}},
     "scheduler.params.warmup_max_lr is true; expected a number"),
])
def test_a_value_of_the_wrong_type_is_one_error_naming_key_value_and_type(config, message):
    with pytest.raises(ConfigError, match="^" + re.escape(f"--deepspeed-config ds.json: {message}")):
        translate(config, {}, 1, source="ds.json")


def test_json_numbers_that_are_whole_serve_as_integers():
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}, "steps_per_print": 10.0}
    fields, _, _ = translate(config, {}, 1)
    assert (fields["ddp_bucket_size"], fields["log_interval"]) == (500000000, 10)
    assert type(fields["ddp_bucket_size"]) is int


def test_a_key_contradicting_an_explicit_flag_is_one_error_naming_both(tmp_path):
    path = os.path.join(CONFIGS, "ds_z2_config.json")
    with pytest.raises(ConfigError) as raised:
        parse_args([*MODEL, "--deepspeed_config", path, "--data-parallel-sharding-strategy", "optim_grads_params"])
    assert str(raised.value) == (
        f"--deepspeed-config {path}: zero_optimization.stage (--data-parallel-sharding-strategy optim_grads) "
        "contradicts --data-parallel-sharding-strategy optim_grads_params on the command line. Drop the flag or "
        "change the file.")
    # A flag that agrees with the file, and one that fills its "auto", are fine.
    config = parse_args([*MODEL, "--deepspeed", path, "--data-parallel-sharding-strategy", "optim_grads",
                         "--micro-batch-size", "2"])
    assert (config.parallel.data_parallel_sharding_strategy, config.training.micro_batch_size) == ("optim_grads", 2)
    with pytest.raises(ConfigError, match="--deepspeed needs its config: add --deepspeed_config ds.json"):
        parse_args([*MODEL, "--deepspeed"])


def test_the_summary_prints_the_flags_the_file_became(capsys):
    parse_args([*MODEL, "--deepspeed", "--deepspeed_config", os.path.join(CONFIGS, "ds_fp16_adam_warmup.json")])
    out = capsys.readouterr().out
    assert (" became: --log-interval 1 --clip-grad 1.0 --optimizer adam --lr 0.001 --adam-beta1 0.8 --adam-beta2 "
            "0.999 --adam-eps 1e-08 --weight-decay 3e-07 --fp16 --initial-loss-scale 65536.0 --loss-scale-window 1000 "
            "--hysteresis 2 --min-loss-scale 1.0 --data-parallel-sharding-strategy no_shard --micro-batch-size 2 "
            "--global-batch-size 4 --lr-warmup-style linear --lr-warmup-iters 2 --lr-warmup-init 0.0 --lr-decay-style "
            "constant\n") in out
    assert "ignored" not in out  # wall_clock_breakdown false asks for nothing


def _translated_lrs(tmp_path, scheduler: dict, iterations: int, global_batch: int = 4) -> list[float]:
    """The learning rate of each iteration of a run given ``scheduler`` (and optimizer lr 0.05) in a DeepSpeed file:
    the schedule the training loop builds from the parsed flags, stepped by one global batch per iteration."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "scheduler": scheduler}))
    config = parse_args([*MODEL, "--train-iters", str(iterations), "--micro-batch-size", str(global_batch),
                         "--global-batch-size", str(global_batch), "--deepspeed-config", str(path)])
    schedule = get_optimizer_param_scheduler(SimpleNamespace(param_groups=[{}]), config, global_batch)
    lrs = []
    for _ in range(iterations):
        lrs.append(schedule.get_lr())
        schedule.step(increment=global_batch)
    return lrs


def test_warmup_lr_without_warmup_type_warms_up_as_deepspeeds_log(tmp_path):
    """DeepSpeed's documented WarmupLR example leaves warmup_type out: its default, log. By hand, as DeepSpeed's
    engine counts: the scheduler sets warmup_min_lr when built and steps after each optimizer step, so iteration k
    runs at count n = k - 1 with lr = min + (max - min) x ln(n + 1) / ln(warmup_num_steps), until n reaches it."""
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}
    expected = [0.01] + [0.01 + 0.09 * math.log(n + 1) / math.log(10) if n < 10 else 0.1 for n in range(13)]
    assert _translated_lrs(tmp_path, {"type": "WarmupLR", "params": params}, 14) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("scheduler", [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}},
    {"type": "WarmupLR", "params": {"warmup_num_steps": 1}},  # max lr: the optimizer's; the warmup raised to 2
    {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 12, "cos_min_ratio": 0.01}},
])
def test_log_warmup_equals_deepspeeds_own_scheduler(tmp_path, scheduler):
    """Against DeepSpeed's own class (when installed), driven as its engine drives it."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    deepspeed_scheduler = getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])
    deepspeed_lrs = []
    for _ in range(15):
        deepspeed_lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        deepspeed_scheduler.step()
    assert _translated_lrs(tmp_path, scheduler, 15) == pytest.approx(deepspeed_lrs, abs=1e-12)


def _losses(flags: list[str]) -> list[float]:
    state, _, _ = pretrain(parse_args([*MODEL, *flags]), keep_process_group=True)
    return state.losses


FP16_FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "4", "--clip-grad", "1.0", "--optimizer", "adam",
              "--lr", "0.001", "--adam-beta1", "0.8", "--adam-beta2", "0.999", "--adam-eps", "1e-8", "--weight-decay",
              "3e-7", "--lr-warmup-init", "0", "--lr-warmup-iters", "2", "--lr-warmup-style", "linear",
              "--lr-decay-style", "constant", "--fp16",
              "--initial-loss-scale", "65536", "--loss-scale-window", "1000", "--hysteresis", "2",
              "--min-loss-scale", "1"]


def test_fp16_file_with_initial_scale_power_16_trains_as_the_flags():
    from_file = _losses(["--deepspeed-config", os.path.join(CONFIGS, "ds_fp16_adam_warmup.json")])
    assert from_file == _losses(FP16_FLAGS) and len(from_file) == 3


SCALER_FLAGS = ["--initial-loss-scale", "65536", "--loss-scale-window", "1000", "--hysteresis", "2",
                "--min-loss-scale", "1"]  # the files' fp16 block: set, though fp16 stays off ("auto")
ZERO_FLAGS = {"ds_z2_config.json": ["--data-parallel-sharding-strategy", "optim_grads", "--ddp-bucket-size",
                                    "500000000", *SCALER_FLAGS],
              "ds_z3_offload_config.json": ["--data-parallel-sharding-strategy", "optim_grads_params",
                                            "--optimizer-cpu-offload", "--grad-cpu-offload", *SCALER_FLAGS]}


def test_each_file_parses_to_the_config_of_its_flags():
    """Losses cannot tell ZeRO stages apart (they are equal by design): the configs must be equal too."""
    batch = ["--micro-batch-size", "2", "--global-batch-size", "4"]
    pairs = [(["--deepspeed-config", os.path.join(CONFIGS, "ds_fp16_adam_warmup.json")], FP16_FLAGS)]
    pairs += [([*batch, "--deepspeed", os.path.join(CONFIGS, name)], [*batch, *flags])
              for name, flags in ZERO_FLAGS.items()]
    for from_file, from_flags in pairs:
        assert parse_args([*MODEL, *from_file]).to_dict() == parse_args([*MODEL, *from_flags]).to_dict()


def _zero_runs(rank, world_size):
    batch = ["--micro-batch-size", "2", "--global-batch-size", "8"]  # the files leave the batch "auto"
    return {name: (_losses([*batch, "--deepspeed", os.path.join(CONFIGS, name)]), _losses([*batch, *flags]))
            for name, flags in ZERO_FLAGS.items()}


def test_zero2_and_zero3_offload_files_train_as_the_flags_at_dp2(run_distributed):
    results = run_distributed(_zero_runs, world_size=2)[-1]  # the last rank has the loss
    for name, (from_file, from_flags) in results.items():
        assert from_file == from_flags and len(from_file) == 3, name
