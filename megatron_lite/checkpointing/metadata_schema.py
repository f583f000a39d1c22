"""What a checkpoint's ``metadata.json`` and ``latest_checkpointed_iteration.txt`` may hold, checked as they are read.

A checkpoint may be truncated, hand-edited or forged. Unchecked, a bad value surfaces later on every
rank as a KeyError, an IndexError or a RecursionError, or it loads: a training state at iteration
10**18 "resumes" a run that then trains nothing and exits 0. So both files are parsed here (the JSON
with its nesting bounded first) and every value the loader uses is checked for its type, its range
and its agreement with the others (a tensor's shards with its shape and split, the training state's
iteration with the checkpoint's). A violation is one ``SchemaError`` naming the key, as a path:
``tensors["embedding.word_embeddings.weight"].global_shape[1]``; ``storage`` adds the file.

The schema is written as data: each key maps to a check built from the few below (``_integer``,
``_list_of``, ``_record``, ...); the run configuration's checks come from its dataclasses' types.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import types
import typing

from megatron_lite.checkpointing.training_state import TrainingState
from megatron_lite.config import SECTIONS

FORMAT_VERSION = "megatron_lite-checkpoint/1"

# Ours nest 6 deep; far deeper is not a checkpoint of ours, and would exhaust the parser's recursion.
MAX_DEPTH = 32
# Iterations and samples: 2**40 iterations at one a second take 35,000 years, and 2**40 samples of
# 4,096 tokens are some 300 times the largest training sets.
MAX_COUNT = 2 ** 40
_MAX_SIZE = 2 ** 62  # bytes of a file, elements of a tensor dimension
_MAX_RANKS = 2 ** 24


class SchemaError(ValueError):
    """A value that breaks the schema; the message starts with the key's path."""


def _fail(where: str, problem: str):
    raise SchemaError(f"{where or 'the top level'} {problem}")


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_tracker(text: str) -> int:
    """The iteration ``latest_checkpointed_iteration.txt`` names (its text, stripped of whitespace)."""
    # ASCII digits only: str.isdigit() accepts "²", which int() then refuses.
    if not re.fullmatch(r"[0-9]{1,13}", text) or int(text) >= MAX_COUNT:
        shown = repr(text[:40]) + (f" ({len(text)} characters)" if len(text) > 40 else "")
        raise SchemaError(f"should hold an iteration number from 0 to {MAX_COUNT - 1} but holds {shown}")
    return int(text)


def parse_metadata(text: str) -> dict:
    """``metadata.json``'s text -> the checked metadata."""
    _check_depth(text)
    try:
        metadata = json.loads(text)
    except ValueError as error:  # JSONDecodeError, or an integer of more digits than Python converts
        raise SchemaError(f"is not valid JSON ({error})") from None
    _object(metadata, "")
    _equal(FORMAT_VERSION)(metadata.get("format"), "format")  # first: another version has other keys
    _METADATA(metadata, "")
    _check_agreement(metadata)
    return metadata


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before the (recursive) parser meets it."""
    brackets = re.sub(r'"(?:[^"\\]|\\.)*"|[^\[\]{}]', "", text)  # strings may hold brackets
    depth = max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if depth > MAX_DEPTH:
        raise SchemaError(f"nests {depth} levels deep, a checkpoint's at most {MAX_DEPTH}")


# ---------------------------------------------------------------------------------------------
# Checks: each is called as check(value, where) and raises SchemaError


def _integer(low: int = 0, high: int = MAX_COUNT):
    def check(value, where):
        if type(value) is not int or not low <= value < high:  # type(): True is an int to isinstance
            _fail(where, f"must be an integer from {low} to {high - 1}, not {_shown(value)}")
    return check


def _of_type(*kinds):
    def check(value, where):
        if type(value) not in kinds:
            _fail(where, f"must be {' or '.join(_JSON_NAMES[k] for k in kinds)}, not {_shown(value)}")
    return check


_JSON_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}
_string, _boolean, _number = _of_type(str), _of_type(bool), _of_type(int, float)
_object, _list = _of_type(dict), _of_type(list)


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else _JSON_NAMES[type(value)]
    return text if len(text) <= 40 else text[:40] + "..."


def _optional(check):
    def optional(value, where):
        if value is not None:
            check(value, where)
    return optional


def _list_of(check):
    def list_of(value, where):
        _list(value, where)
        for i, item in enumerate(value):
            check(item, f"{where}[{i}]")
    return list_of


def _tuple_of(*checks):
    """A list of ``len(checks)`` values, the i-th checked by the i-th check."""
    def tuple_of(value, where):
        _list(value, where)
        if len(value) != len(checks):
            _fail(where, f"must hold {len(checks)} values, not {len(value)}")
        for i, (check, item) in enumerate(zip(checks, value)):
            check(item, f"{where}[{i}]")
    return tuple_of


def _mapping_of(check, key=None):
    def mapping_of(value, where):
        _object(value, where)
        for name, item in value.items():
            if key is not None and not key(name):
                _fail(f"{where}[{name!r}]", "is not a key this object may hold")
            check(item, f"{where}[{name!r}]")
    return mapping_of


def _record(required: dict, optional: dict | None = None):
    """An object with exactly these keys: ``required`` ones, and any of ``optional``."""
    optional = optional or {}

    def record(value, where):
        _object(value, where)
        for name in required.keys() - value.keys():
            _fail(_join(where, name), "is missing")
        for name, item in value.items():
            check = required.get(name, optional.get(name))
            if check is None:
                _fail(_join(where, name), f"is not a key of this object (it holds {', '.join(sorted(required))})")
            check(item, _join(where, name))
    return record


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _equal(expected):
    def equal(value, where):
        if value != expected:
            _fail(where, f"is {_shown(value)}; this megatron_lite reads {_shown(expected)}")
    return equal


def _sha256(value, where):
    if type(value) is not str or not re.fullmatch(r"[0-9a-f]{64}", value):
        _fail(where, f"must be a SHA-256 (64 hexadecimal digits), not {_shown(value)}")


# ---------------------------------------------------------------------------------------------
# The run configuration: each section's fields, checked by their declared types


def _of_annotation(hint):
    """The check of a configuration field from its type: int, float, bool, str, list[int], Optional[...]."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _optional(_of_annotation(inner))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return _list_of(_of_annotation(item))
    # A float field written from an integer default (lr 0) is an integer in the JSON.
    return {int: _integer(-2 ** 63, 2 ** 63), float: _number, bool: _boolean, str: _string, list: _list,
            dict: _object}[hint]


def _section(cls):
    """A configuration section: any of its fields (a missing one takes its default, as Config.from_dict)."""
    hints = typing.get_type_hints(cls)
    return _record({}, {f.name: _of_annotation(hints[f.name]) for f in dataclasses.fields(cls)})


_CONFIG = _record({"model": _section(SECTIONS["model"])},
                  {name: _section(cls) for name, cls in SECTIONS.items() if name != "model"})


# ---------------------------------------------------------------------------------------------
# metadata.json


_count = _integer()
_rank_count = _integer(1, _MAX_RANKS)

# peft_base.pointer_to and pointer_to_initialisation: a base checkpoint, or the random initialisation.
_BASE_CHECKPOINT = _record({"directory": _string, "iteration": _count, "metadata_sha256": _sha256})
_BASE_INITIALISATION = _record({"init_seed": _integer(-2 ** 63, 2 ** 63), "init_method_std": _number})


def _peft_base(value, where):
    _object(value, where)
    (_BASE_CHECKPOINT if "directory" in value else _BASE_INITIALISATION)(value, where)


# TrainingState's fields, by their types, and its counters in their range; a weights-only checkpoint records its
# iteration only.
_TRAINING_STATE = _record({"iteration": _count}, {
    **{name: _of_annotation(hint) for name, hint in typing.get_type_hints(TrainingState).items()},
    "consumed_train_samples": _count, "skipped_iterations": _count, "nan_iterations": _count,
    "losses": _list_of(_number), "peft_base": _optional(_peft_base)})

_LAYOUT = _record({"world_size": _rank_count, "tensor_model_parallel_size": _rank_count,
                   "pipeline_model_parallel_size": _rank_count, "data_parallel_size": _rank_count,
                   "virtual_pipeline_model_parallel_size": _optional(_rank_count),
                   "use_distributed_optimizer": _boolean},
                  {"expert_model_parallel_size": _rank_count, "expert_tensor_parallel_size": _rank_count})

_FILE = _record({"size": _integer(0, _MAX_SIZE), "sha256": _sha256},
                {"rank": _integer(0, _MAX_RANKS), "layers": _list_of(_count),
                 "tensor_model_parallel_rank": _integer(0, _MAX_RANKS),
                 "pipeline_model_parallel_rank": _integer(0, _MAX_RANKS),
                 "data_parallel_rank": _integer(0, _MAX_RANKS)})

_SHARD = _record({"file": _string, "tp_rank": _integer(0, _MAX_RANKS), "tp_size": _rank_count,
                  "flat_range": _optional(_tuple_of(_integer(0, _MAX_SIZE), _integer(0, _MAX_SIZE)))})

_TENSOR = _record({"global_shape": _list_of(_integer(0, _MAX_SIZE)), "dtype": _string,
                   "partition_dim": _optional(_integer(0, 8)), "partition_stride": _integer(1, _MAX_RANKS),
                   "vocab_size": _optional(_integer(0, _MAX_SIZE)), "shards": _list_of(_SHARD)})

# Python's and numpy's generator scalars (rng.get_rng_state); their tensors are in the rank's file.
_RNG = _record({"python": _tuple_of(_integer(-2 ** 63, 2 ** 63), _optional(_number)),
                "numpy": _tuple_of(_string, _integer(0, 625), _integer(0, 2), _number)})

# The optimizer's param groups are torch's (their keys vary by version) and the scheduler's values are
# compared with the run's by the scheduler itself: both are checked only where the loader indexes them.
_OPTIMIZER = _optional(_record({"param_groups": _list_of(_object), "grad_scaler": _optional(_object),
                                "num_skipped_iterations": _count}))


def _scheduler(value, where):
    _object(value, where)
    if "num_steps" not in value:
        _fail(_join(where, "num_steps"), "is missing")
    _count(value["num_steps"], _join(where, "num_steps"))


_METADATA = _record({
    "format": _equal(FORMAT_VERSION), "iteration": _count, "training_state": _TRAINING_STATE, "config": _CONFIG,
    "layout": _LAYOUT, "scheduler": _optional(_scheduler), "optimizer": _OPTIMIZER,
    "tensors": _mapping_of(_TENSOR), "files": _mapping_of(_FILE),
    "rng": _mapping_of(_RNG, key=lambda name: re.fullmatch(r"[0-9]{1,8}", name) is not None)})


def _check_agreement(metadata: dict) -> None:
    """What the per-key checks cannot see: values that must agree with each other."""
    saved, state = metadata["iteration"], metadata["training_state"]["iteration"]
    if state != saved:
        _fail("training_state.iteration", f"is {state}, but the checkpoint is of iteration {saved} (iteration)")
    world_size = metadata["layout"]["world_size"]
    if metadata["rng"] and set(metadata["rng"]) != {str(r) for r in range(world_size)}:
        _fail("rng", f"must hold one entry per rank, 0 to {world_size - 1} (layout.world_size)")
    for key, entry in metadata["tensors"].items():
        _check_split(entry, f"tensors[{key!r}]", metadata["files"])


def _check_split(entry: dict, where: str, files: dict) -> None:
    """A tensor's shape, its tensor-parallel split and its shards describe one tensor."""
    shape, dim = entry["global_shape"], entry["partition_dim"]
    tp_sizes = {shard["tp_size"] for shard in entry["shards"]}
    if not entry["shards"] or len(tp_sizes) != 1:
        _fail(f"{where}.shards", "must be one or more shards of one tensor-parallel size")
    (tp_size,) = tp_sizes
    if dim is None and tp_size != 1:
        _fail(f"{where}.shards", f"split a tensor with no partition_dim over {tp_size} tensor-parallel ranks")
    local = list(shape)
    if dim is not None:
        if dim >= len(shape):
            _fail(f"{where}.partition_dim", f"is {dim}, but global_shape {shape} has {len(shape)} dimensions")
        parts = tp_size * entry["partition_stride"]
        if shape[dim] % parts:
            _fail(f"{where}.global_shape[{dim}]", f"is {shape[dim]}, which does not split into {parts} equal parts "
                                                  f"(tp_size {tp_size} x partition_stride {entry['partition_stride']})")
        local[dim] //= tp_size
    if entry["vocab_size"] is not None and (not shape or entry["vocab_size"] > shape[0]):
        _fail(f"{where}.vocab_size", f"is {entry['vocab_size']}, more than the {shape[:1]} rows of the tensor")
    numel = math.prod(local)
    for i, shard in enumerate(entry["shards"]):
        if shard["tp_rank"] >= tp_size:
            _fail(f"{where}.shards[{i}].tp_rank", f"is {shard['tp_rank']}, not below tp_size {tp_size}")
        if shard["file"] not in files:
            _fail(f"{where}.shards[{i}].file", f"is {shard['file']!r}, which files does not list")
        if shard["flat_range"] is not None and not 0 <= shard["flat_range"][0] <= shard["flat_range"][1] <= numel:
            _fail(f"{where}.shards[{i}].flat_range", f"is {shard['flat_range']}, not a range within the shard's "
                                                     f"{numel} elements")
