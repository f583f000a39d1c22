"""DeepSpeed's JSON config as megatron_lite's own flags: ``--deepspeed-config ds.json`` (also DeepSpeed's
``--deepspeed_config`` and the Hugging Face Trainer's ``--deepspeed ds.json``).

The file is translated, never run on DeepSpeed: each key becomes the field of the flag that does the same
here (the table is in docs/coming_from_hf_and_deepspeed.md), and the run is then an ordinary megatron_lite
run. ``translate`` is a pure function of the file, the explicitly given field values and the world size, so
it serves whichever parser reads the command line. Its rules:

- ``"auto"`` (the Trainer's placeholder) and a key the file leaves out keep the flag's value or default;
- the batch triad is checked as DeepSpeed checks it: train_batch_size = train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x data-parallel size, the missing one derived from the other two;
- a key we do not implement stops the run with one error listing every such key (a misspelled one named with
  the key it is closest to, as a mistyped flag is); a knob that changes only speed or memory is named in one
  notice; a key that contradicts an explicit flag is an error naming both;
- an error of the configuration's checks names a value that came from the file by its key
  (``scheduler.params.warmup_num_steps``), not by the flag the user never typed (``errors_name_json_keys``);
- ZeRO that shards over one data-parallel rank, or ZeRO-2/3 beside pipeline parallelism (which DeepSpeed
  refuses, and megatron_lite runs), is said in one note (``layout_note``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
from dataclasses import dataclass, field

from megatron_lite.cli.parser import nearest_name
from megatron_lite.config import (LR_WARMUP_STYLES, SHARDING_STRATEGIES, ConfigError, OptimizerConfig, as_flags,
                                  flag_name)

DEEPSPEED_SPELLINGS = ("--deepspeed-config", "--deepspeed_config")

# Keys that change only speed or memory, never a result: named in the notice, otherwise ignored.
PERFORMANCE_KNOBS = {
    "zero_optimization": {"allgather_partitions", "allgather_bucket_size", "reduce_scatter", "round_robin_gradients",
                          "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                          "stage3_max_live_parameters", "stage3_max_reuse_distance", "elastic_checkpoint",
                          "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "memory_efficient_linear", "ignore_unused_parameters", "load_from_fp32_weights"},
    "offload": {"pin_memory", "buffer_count", "buffer_size", "fast_init", "max_in_cpu"},
    "": {"wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_force_ds_cpu_optimizer"},
    "optimizer.params": {"torch_adam", "fused"},
}
# Keys whose DeepSpeed value asks for nothing beyond what we do; any other value is unsupported.
HARMLESS_VALUES = {"zero_allow_untested_optimizer": (True, False), "prescale_gradients": (False,),
                   "gradient_predivide_factor": (1, 1.0), "fp16.consecutive_hysteresis": (False,),
                   "fp16.auto_cast": (False,), "fp16.fp16_master_weights_and_grads": (False,),
                   "optimizer.params.adam_w_mode": (True,), "optimizer.params.amsgrad": (False,),
                   "scheduler.params.last_batch_iteration": (-1,), "zero_optimization.contiguous_gradients": (True,)}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# DeepSpeed's own keys that we do not implement: refused as such, never taken for a misspelling of a key we read
# (gradient_accumulation_dtype is close to gradient_accumulation_steps).
DEEPSPEED_ONLY_KEYS = {"activation_checkpointing", "aio", "amp", "autotuning", "checkpoint", "comms_logger",
                       "communication_data_type", "compression_training", "csv_monitor", "curriculum_learning",
                       "data_efficiency", "data_types", "elasticity", "flops_profiler", "gradient_accumulation_dtype",
                       "pipeline", "seq_parallel_communication_data_type", "sparse_attention", "sparse_gradients"}


def add_deepspeed_flags(parser: argparse.ArgumentParser) -> None:
    """Registers the three spellings; ``translate_deepspeed_flags`` pops what they parse to."""
    group = parser.add_argument_group("DeepSpeed config (translated onto megatron_lite's own engine)")
    group.add_argument(*DEEPSPEED_SPELLINGS, dest="deepspeed_config", metavar="JSON", default=argparse.SUPPRESS,
                       help="DeepSpeed JSON config, translated into megatron_lite's flags (see "
                            "docs/coming_from_hf_and_deepspeed.md)")
    group.add_argument("--deepspeed", dest="deepspeed", nargs="?", const=True, metavar="JSON",
                       default=argparse.SUPPRESS,
                       help="DeepSpeed's switch (then give --deepspeed_config), or the Trainer's --deepspeed ds.json")


def translate_deepspeed_flags(values: dict, world_size: int) -> tuple[dict, list[str], dict]:
    """Pops the DeepSpeed flags from the parsed ``values`` (explicit flags only, by field name); returns the
    values with the file's fields added, the notices to print, and {field: the file's key, as errors name it}
    for ``errors_name_json_keys``. Raises ConfigError."""
    switch, path = values.pop("deepspeed", None), values.pop("deepspeed_config", None)
    if isinstance(switch, str):
        if path is not None and path != switch:
            raise ConfigError(f"--deepspeed {switch} and --deepspeed_config {path} name two DeepSpeed configs; "
                              "give one.")
        path = switch
    if path is None:
        if switch:
            raise ConfigError("--deepspeed needs its config: add --deepspeed_config ds.json (megatron_lite "
                              "translates the file onto its own engine).")
        return values, [], {}
    translated, ignored, keys = translate(read_deepspeed_config(path), values, world_size, source=path)
    notices = [f"--deepspeed-config {path} became: {as_flags(translated) or '(no flags)'}"]
    if ignored:
        notices.append(f"--deepspeed-config {path}: ignored (they change only speed or memory): {', '.join(ignored)}")
    note = layout_note(translated, keys, values, world_size)
    if note:
        notices.append(f"--deepspeed-config {path}: {note}")
    # A value the command line gave too (and the file agreed with) the user did type as a flag.
    json_keys = {name: f"{path}'s {key}" for name, key in keys.items() if name not in values}
    return {**values, **translated}, notices, json_keys


@contextlib.contextmanager
def errors_name_json_keys(json_keys: dict):
    """Within it, a ConfigError that names the flag of a field the DeepSpeed file set names the file's key
    instead: ``--lr-warmup-iters (10) must be smaller than ...`` becomes ``ds.json's
    scheduler.params.warmup_num_steps (10) must be smaller than ...``. ``json_keys``: field -> what to call it
    (``translate_deepspeed_flags``'s third value)."""
    try:
        yield
    except ConfigError as error:
        message = str(error)
        for name, key in json_keys.items():
            # The whole flag only: --lr is not the start of --lr-decay-iters.
            message = re.sub(rf"(?<![\w-]){re.escape(flag_name(name))}(?![\w-])", lambda _: key, message)
        if message == str(error):
            raise
        raise ConfigError(message) from None


def layout_note(translated: dict, keys: dict, explicit: dict, world_size: int) -> str | None:
    """What the file's ZeRO stage does on this layout, when it is not what a DeepSpeed user expects: sharding
    over one data-parallel rank saves nothing, and DeepSpeed's pipeline engine refuses ZeRO-2/3 (stages that
    shard gradients, which its pipeline schedule accumulates whole), where megatron_lite's runs them (its
    parity ladder: pp2 x dp2 at every stage trains as one process does)."""
    strategy = translated.get("data_parallel_sharding_strategy")
    stage = SHARDING_STRATEGIES.index(strategy) if strategy else 0
    if stage == 0:
        return None
    tp, pp, cp = (explicit.get(f"{name}_size", 1) for name in ("tensor_model_parallel", "pipeline_model_parallel",
                                                                "context_parallel"))
    dp = max(world_size // (tp * pp * cp), 1)
    parts = []
    if dp == 1:
        parts.append(f"{keys['data_parallel_sharding_strategy']} {stage} shards over the data-parallel ranks, and "
                     f"this run has one ({world_size} processes / tensor {tp} x pipeline {pp} x context {cp}), so "
                     f"the sharding saves no memory: add processes or lower the model-parallel sizes")
    if stage >= 2 and pp > 1:
        parts.append(f"DeepSpeed refuses ZeRO stage {stage} with pipeline parallelism (its pipeline engine takes "
                     f"stages 0 and 1 only); megatron_lite runs it (--data-parallel-sharding-strategy {strategy} "
                     f"with --pipeline-model-parallel-size {pp}), so this file and these flags would not run on "
                     f"DeepSpeed")
    return "; ".join(parts) + "." if parts else None


def read_deepspeed_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed-config {path} does not exist; give DeepSpeed's JSON config file.")
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--deepspeed-config {path}:{error.lineno}: not JSON ({error.msg}).") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--deepspeed-config {path} must hold a JSON object.")
    return config


@dataclass
class _Translation:
    """Fields the file sets (with the key that set each), and the keys it cannot or need not honour."""

    source: str
    fields: dict = field(default_factory=dict)  # field name -> (value, key)
    unsupported: list = field(default_factory=list)
    misspelled: list = field(default_factory=list)  # "key (did you mean known?)"
    ignored: list = field(default_factory=list)

    def set(self, name: str, value, key: str) -> None:
        if value != "auto":
            self.fields[name] = (value, key)

    def value(self, name: str, explicit: dict, default):
        """The value a field will have: the file's, else the command line's, else ``default``."""
        return self.fields[name][0] if name in self.fields else explicit.get(name, default)

    def typed(self, value, key: str, kind: type):
        """``value`` as ``kind`` (bool, int or float), "auto" kept. JSON gives numbers as int or float (5e8 is a
        float, an integral one is an int here); anything else (a string, a list, true for a number) is one
        ConfigError naming the key, the value and the type, where DeepSpeed would fail later in a traceback."""
        if value == "auto":
            return value
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is bool and isinstance(value, bool) or kind is float and is_number:
            return kind(value)
        if kind is int and is_number and float(value).is_integer():
            return int(value)
        expected = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise ConfigError(f"--deepspeed-config {self.source}: {key} is {json.dumps(value)}; expected {expected} "
                          '(or "auto" to keep the flag\'s value).')


def translate(config: dict, explicit: dict, world_size: int, *,
              source: str = "ds.json") -> tuple[dict, list[str], dict]:
    """(field values the DeepSpeed ``config`` becomes, the performance keys ignored, the key that set each
    field); raises ConfigError for unsupported or misspelled keys (all listed), a broken batch triad, or a
    value contradicting an ``explicit`` field."""
    t = _Translation(source)
    for key, value in config.items():
        handler = _TOP_LEVEL.get(key)
        if handler is not None:
            handler(t, value, key)
        elif key in PERFORMANCE_KNOBS[""]:
            t.ignored += [key] if value else []  # false asks for nothing
        else:
            _harmless_or_unsupported(t, key, value)
    _batch_triad(t, config, explicit, world_size)
    _scheduler(t, config.get("scheduler"), explicit)
    if t.unsupported or t.misspelled:
        problems = ([f"megatron_lite does not implement {'; '.join(t.unsupported)}"] if t.unsupported else []) + (
            [f"unknown keys {'; '.join(t.misspelled)}"] if t.misspelled else [])
        fix = "Remove these keys" if not t.misspelled else "Correct the misspelled keys and remove any others"
        raise ConfigError(f"--deepspeed-config {source}: {'. '.join(problems)}. {fix} (the table of supported keys "
                          f"is in docs/coming_from_hf_and_deepspeed.md).")
    _check_contradictions(t, explicit)
    return ({name: value for name, (value, _) in t.fields.items()}, t.ignored,
            {name: key for name, (_, key) in t.fields.items()})


def _harmless_or_unsupported(t: _Translation, key: str, value) -> None:
    if key in HARMLESS_VALUES and value in HARMLESS_VALUES[key]:
        return
    if isinstance(value, dict) and value.get("enabled") is False:  # a feature switched off asks for nothing
        return
    section, _, name = key.rpartition(".")
    meant = None if name in DEEPSPEED_ONLY_KEYS else nearest_name(name, KNOWN_KEYS.get(section, ()))
    if meant is not None and meant != name:
        t.misspelled.append(f"{key} (did you mean {f'{section}.' if section else ''}{meant}?)")
    else:
        t.unsupported.append(f"{key} {json.dumps(value)}" if key in HARMLESS_VALUES else key)


def _section(t: _Translation, value, key: str) -> dict:
    if not isinstance(value, dict):
        t.unsupported.append(f"{key} {json.dumps(value)} (expected an object)")
        return {}
    return value


def _direct(name: str, kind: type):
    """A key that is one field: ``gradient_clipping`` -> clip_grad."""
    def handle(t: _Translation, value, key: str) -> None:
        t.set(name, t.typed(value, key, kind), key)
    return handle


def _zero_optimization(t: _Translation, value, key: str) -> None:
    zero = _section(t, value, key)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        t.unsupported.append(f"{key}.stage {stage} (stages are 0 to 3)")
        stage = 0
    t.set("data_parallel_sharding_strategy", SHARDING_STRATEGIES[stage], f"{key}.stage")
    for name, item in zero.items():
        path = f"{key}.{name}"
        if name == "stage":
            continue
        if name == "offload_optimizer":
            _offload(t, item, path, stage, parameters=False)
        elif name == "offload_param":
            _offload(t, item, path, stage, parameters=True)
        elif name == "overlap_comm":
            t.set("overlap_grad_reduce", t.typed(item, path, bool), path)
        elif name == "reduce_bucket_size":
            t.set("ddp_bucket_size", t.typed(item, path, int), path)
        elif name == "contiguous_gradients" and item is False:
            t.ignored.append(f"{path} false (gradients always live in one contiguous buffer here)")
        elif name in PERFORMANCE_KNOBS["zero_optimization"]:
            t.ignored.append(path)
        else:
            _harmless_or_unsupported(t, path, item)


def _offload(t: _Translation, value, key: str, stage: int, *, parameters: bool) -> None:
    """ZeRO-Offload: the optimizer steps on the host (--optimizer-cpu-offload), with the gradient shards there
    too at stages 2 and 3 (--grad-cpu-offload). Parameters: the fp32 main copy is already on the host with
    --optimizer-cpu-offload; the working copies stay on the device, a memory difference only."""
    offload = _section(t, value, key)
    device = offload.get("device", "none")
    if device in ("none", None):
        return
    if device != "cpu":
        t.unsupported.append(f"{key}.device {device} (only cpu)")
        return
    if parameters:
        if stage != 3:
            t.unsupported.append(f"{key} at stage {stage} (DeepSpeed offloads parameters only at stage 3)")
        t.ignored.append(f"{key} (the fp32 main parameters are on the host with the optimizer; the working "
                         "copies stay on the device)")
    t.set("optimizer_cpu_offload", True, key)
    if stage >= 2:
        t.set("grad_cpu_offload", True, key)
    for name, item in offload.items():
        if name == "device":
            continue
        if name in PERFORMANCE_KNOBS["offload"]:
            t.ignored.append(f"{key}.{name}")
        else:
            _harmless_or_unsupported(t, f"{key}.{name}", item)


def _fp16(t: _Translation, value, key: str) -> None:
    """fp16.loss_scale 0 means dynamic scaling (our --loss-scale unset); initial_scale_power N means 2^N."""
    fp16 = _section(t, value, key)
    enabled = fp16.get("enabled", False)
    t.set("fp16", t.typed(enabled, f"{key}.enabled", bool), f"{key}.enabled")
    if enabled is False:
        return  # its scaler settings configure nothing
    for name, item in fp16.items():
        path = f"{key}.{name}"
        if name == "enabled" or item == "auto":
            continue
        if name == "loss_scale":
            t.set("loss_scale", None if item == 0 else t.typed(item, path, float), path)
        elif name == "initial_scale_power":
            t.set("initial_loss_scale", float(2 ** t.typed(item, path, int)), path)
        elif name in ("loss_scale_window", "hysteresis"):
            t.set(name, t.typed(item, path, int), path)
        elif name == "min_loss_scale":
            t.set("min_loss_scale", t.typed(item, path, float), path)
        else:
            _harmless_or_unsupported(t, path, item)


def _bf16(t: _Translation, value, key: str) -> None:
    bf16 = _section(t, value, key)
    enabled = bf16.get("enabled", False)
    t.set("bf16", t.typed(enabled, f"{key}.enabled", bool), f"{key}.enabled")
    for name, item in bf16.items():
        if name != "enabled":
            _harmless_or_unsupported(t, f"{key}.{name}", item)


def _optimizer(t: _Translation, value, key: str) -> None:
    """DeepSpeed's Adam is AdamW unless adam_w_mode is false (decoupled weight decay), as our adam is."""
    optimizer = _section(t, value, key)
    kind = optimizer.get("type", "")
    if str(kind).lower() not in ("adam", "adamw"):
        t.unsupported.append(f"{key}.type {kind} (only Adam and AdamW)")
    t.set("optimizer", "adam", f"{key}.type")
    params = _section(t, optimizer.get("params", {}), f"{key}.params")
    for name, item in params.items():
        path = f"{key}.params.{name}"
        if name in _ADAM_PARAMS:
            t.set(_ADAM_PARAMS[name], t.typed(item, path, float), path)
        elif name == "betas" and item != "auto":
            if not isinstance(item, list) or len(item) != 2:
                raise ConfigError(f"--deepspeed-config {t.source}: {path} is {json.dumps(item)}; expected two "
                                  "numbers, [beta1, beta2].")
            t.set("adam_beta1", t.typed(item[0], path + "[0]", float), path)
            t.set("adam_beta2", t.typed(item[1], path + "[1]", float), path)
        elif name in PERFORMANCE_KNOBS["optimizer.params"]:
            t.ignored.append(path)
        elif item != "auto":
            _harmless_or_unsupported(t, path, item)
    for name, item in optimizer.items():
        if name not in ("type", "params"):
            _harmless_or_unsupported(t, f"{key}.{name}", item)


_ADAM_PARAMS = {"lr": "lr", "eps": "adam_eps", "weight_decay": "weight_decay"}  # DeepSpeed's name -> our field


def _scheduler(t: _Translation, value, explicit: dict) -> None:
    """WarmupLR: warmup from warmup_min_lr to warmup_max_lr (default: the optimizer's lr), then constant;
    WarmupDecayLR: then linear decay back to warmup_min_lr at total_num_steps; WarmupCosineLR: warmup from
    warmup_min_ratio x lr, then cosine decay to cos_min_ratio x lr (ratios of the optimizer's lr). The warmup is
    warmup_type log (DeepSpeed's default: --lr-warmup-style log) or linear, over at least 2 steps (DeepSpeed
    raises a shorter warmup_num_steps to 2). Steps are optimizer steps: iterations."""
    if value is None:
        return
    scheduler = _section(t, value, "scheduler")
    kind = scheduler.get("type")
    params = dict(_section(t, scheduler.get("params", {}), "scheduler.params"))
    if kind not in SCHEDULERS:
        t.unsupported.append(f"scheduler.type {kind} (only {', '.join(SCHEDULERS)})")
        return
    path = "scheduler.params."
    warmup_steps = t.typed(params.pop("warmup_num_steps", 1000), path + "warmup_num_steps", int)  # DeepSpeed's
    warmup_type = params.pop("warmup_type", "log")  # defaults, where a key is absent
    if warmup_type not in LR_WARMUP_STYLES:
        t.unsupported.append(f"{path}warmup_type {warmup_type} (only {' and '.join(LR_WARMUP_STYLES)})")
    t.set("lr_warmup_style", warmup_type, path + "warmup_type")
    t.set("lr_warmup_iters", warmup_steps if warmup_steps == "auto" else max(2, warmup_steps),
          path + "warmup_num_steps")
    if kind == "WarmupCosineLR":
        lr = t.value("lr", explicit, OptimizerConfig().lr)
        min_ratio = t.typed(params.pop("warmup_min_ratio", 0.0), path + "warmup_min_ratio", float)
        cos_ratio = t.typed(params.pop("cos_min_ratio", 0.0001), path + "cos_min_ratio", float)
        t.set("lr_warmup_init", lr * min_ratio, path + "warmup_min_ratio")
        t.set("min_lr", lr * cos_ratio, path + "cos_min_ratio")
        t.set("lr_decay_style", "cosine", "scheduler.type")
    else:
        min_lr = t.typed(params.pop("warmup_min_lr", 0.0), path + "warmup_min_lr", float)
        max_lr = t.typed(params.pop("warmup_max_lr", "auto"), path + "warmup_max_lr", float)  # absent: the lr's
        t.set("lr", max_lr, path + "warmup_max_lr")
        t.set("lr_warmup_init", min_lr, path + "warmup_min_lr")
        if kind == "WarmupDecayLR":
            t.set("min_lr", min_lr, path + "warmup_min_lr")
        t.set("lr_decay_style", "constant" if kind == "WarmupLR" else "linear", "scheduler.type")
    if kind != "WarmupLR":
        total = params.pop("total_num_steps", "auto")
        t.set("lr_decay_iters", t.typed(total, path + "total_num_steps", int), path + "total_num_steps")
    for name, item in params.items():
        _harmless_or_unsupported(t, path + name, item)
    for name, item in scheduler.items():
        if name not in ("type", "params"):
            _harmless_or_unsupported(t, f"scheduler.{name}", item)


def _quotient(total: int, part: int):
    """``total / part`` when it is a whole positive number, else None (the triad's error says why)."""
    return total // part if total % part == 0 and total >= part else None


def _monitor(names: dict):
    """DeepSpeed's tensorboard and wandb monitors -> our logger flags (``names``: their key -> our field)."""
    def handle(t: _Translation, value, key: str) -> None:
        monitor = _section(t, value, key)
        if not monitor.get("enabled", False):
            return
        if key == "tensorboard":  # DeepSpeed writes into output_path/job_name
            path = os.path.join(monitor.get("output_path", ""), monitor.get("job_name", "DeepSpeedJobName"))
            t.set("tensorboard_dir", path, f"{key}.output_path")
        for name, item in monitor.items():
            if name in names:
                t.set(names[name], item, f"{key}.{name}")
            elif name not in ("enabled", "output_path", "job_name"):
                _harmless_or_unsupported(t, f"{key}.{name}", item)
    return handle


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_triad(t: _Translation, config: dict, explicit: dict, world_size: int) -> None:
    """DeepSpeed's rule, train = micro x accumulation x data-parallel size; "auto" or absent: from the flags."""
    given = {key: t.typed(config[key], key, int) for key in _BATCH_KEYS if config.get(key, "auto") != "auto"}
    if not given:
        return
    # Context-parallel ranks share their micro-batches, as tensor and pipeline ranks do.
    model_parallel = (explicit.get("tensor_model_parallel_size", 1) * explicit.get("pipeline_model_parallel_size", 1)
                      * explicit.get("context_parallel_size", 1))
    dp = max(world_size // model_parallel, 1)
    train = given.get("train_batch_size", explicit.get("global_batch_size"))
    micro = given.get("train_micro_batch_size_per_gpu", explicit.get("micro_batch_size"))
    accumulation = given.get("gradient_accumulation_steps")
    if train is None:
        micro, accumulation = micro or 1, accumulation or 1
        train = micro * accumulation * dp
    elif micro is None:
        accumulation = accumulation or 1
        micro = _quotient(train, accumulation * dp)
    elif accumulation is None:
        accumulation = _quotient(train, micro * dp)
    if micro is None or accumulation is None or train != micro * accumulation * dp:
        raise ConfigError(f"--deepspeed-config {t.source}: the batch does not add up, as DeepSpeed checks it: "
                          f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) x "
                          f"gradient_accumulation_steps ({accumulation}) x data-parallel size ({dp} = {world_size} "
                          f"processes / tensor x pipeline x context {model_parallel}) (from the file: "
                          f"{json.dumps(given)}; the rest from --micro-batch-size/--global-batch-size).")
    key = ", ".join(given)
    t.set("micro_batch_size", int(micro), key)
    t.set("global_batch_size", int(train), key)


def _check_contradictions(t: _Translation, explicit: dict) -> None:
    clashes = [f"{key} ({flag_name(name)} {value}) contradicts {flag_name(name)} {explicit[name]} on the command line"
               for name, (value, key) in t.fields.items() if name in explicit and explicit[name] != value]
    if clashes:
        raise ConfigError(f"--deepspeed-config {t.source}: {'; '.join(clashes)}. Drop the flag or change the file.")


_TOP_LEVEL = {"zero_optimization": _zero_optimization, "fp16": _fp16, "bf16": _bf16, "bfloat16": _bf16,
              "optimizer": _optimizer, "gradient_clipping": _direct("clip_grad", float),
              "steps_per_print": _direct("log_interval", int),
              "tensorboard": _monitor({}), "wandb": _monitor({"project": "wandb_project", "team": "wandb_entity"}),
              "scheduler": lambda t, value, key: None,  # after the optimizer, whose lr it may scale
              **{key: (lambda t, value, key: None) for key in _BATCH_KEYS}}  # together, in _batch_triad

# Every key the translation reads, by section ("" the top level): an unknown key close to one of them is taken
# for a misspelling of it.
_OFFLOAD_KEYS = {"device"} | PERFORMANCE_KNOBS["offload"]
KNOWN_KEYS = {
    "": set(_TOP_LEVEL) | PERFORMANCE_KNOBS[""] | {key for key in HARMLESS_VALUES if "." not in key},
    "zero_optimization": {"stage", "offload_optimizer", "offload_param", "overlap_comm", "reduce_bucket_size",
                          "contiguous_gradients"} | PERFORMANCE_KNOBS["zero_optimization"],
    "zero_optimization.offload_optimizer": _OFFLOAD_KEYS, "zero_optimization.offload_param": _OFFLOAD_KEYS,
    "fp16": {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
             "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"},
    "bf16": {"enabled"}, "bfloat16": {"enabled"},
    "optimizer": {"type", "params"},
    "optimizer.params": set(_ADAM_PARAMS) | {"betas", "adam_w_mode", "amsgrad"} | PERFORMANCE_KNOBS["optimizer.params"],
    "scheduler": {"type", "params"},
    "scheduler.params": {"warmup_num_steps", "warmup_type", "warmup_min_ratio", "cos_min_ratio", "warmup_min_lr",
                         "warmup_max_lr", "total_num_steps", "last_batch_iteration"},
    "tensorboard": {"enabled", "output_path", "job_name"}, "wandb": {"enabled", "project", "team"},
}
