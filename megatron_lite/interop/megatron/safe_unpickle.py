"""Read Megatron-LM's pickles without running them.

Megatron-LM saves ``torch.save`` pickles. A pickle names callables that the loader
calls (``__reduce__``), so opening one from someone else can run any code: the
classic payload is ``os.system`` inside ``__reduce__``. And Megatron's ``args``
name Megatron's own classes (``AttnBackend`` and other enums), so a plain loader
would need Megatron installed and would import its modules.

``RestrictedUnpickler`` resolves every name a pickle asks for against a list:

- tensors and storages (``torch._utils._rebuild_tensor_v2`` and the storage types
  torch's zip format names), torch dtypes, layouts and memory formats, ``torch.Size``;
- containers, numbers and strings (``collections.OrderedDict``, ``set``, ``slice``...),
  ``argparse.Namespace`` (Megatron's ``args``), ``io.BytesIO`` (Transformer Engine's
  ``_extra_state``);
- names from Megatron, Transformer Engine, NumPy (the saved RNG states) and
  ``signal`` (``args.exit_signal``) become inert stand-ins: objects that record
  what they were built from and run nothing.

Any other name is refused with one ``UnsafePickleError`` before anything is built.
"""
from __future__ import annotations

import argparse
import collections
import io
import pickle
import types

import torch

from megatron_lite.checkpointing.storage import CheckpointError

# Modules whose names are replaced by stand-ins: their objects are data we read (enum values) or ignore.
STAND_IN_MODULES = ("megatron", "transformer_engine", "apex", "numpy", "signal", "enum")

_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray, ("builtins", "range"): range,
    ("argparse", "Namespace"): argparse.Namespace,
    ("io", "BytesIO"): io.BytesIO,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
}


class UnsafePickleError(CheckpointError):
    """A pickle names something that could run code when loaded."""


class StandIn:
    """An object of a class megatron_lite does not import (a Megatron enum, a NumPy array of a saved
    RNG state). It keeps the arguments and state it was built from: ``value`` is an enum's value."""

    qualified_name = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<stand-in {self.qualified_name}{self.args!r}>"

    def __eq__(self, other) -> bool:
        return (isinstance(other, StandIn) and (self.qualified_name, self.args) == (other.qualified_name, other.args))

    def __hash__(self) -> int:
        return hash((self.qualified_name, self.args))


_stand_ins: dict = {}


def stand_in(module: str, name: str) -> type:
    """The stand-in class for ``module.name`` (one per name, so equal names compare equal)."""
    key = f"{module}.{name}"
    if key not in _stand_ins:
        _stand_ins[key] = type(name, (StandIn,), {"qualified_name": key, "__module__": __name__})
    return _stand_ins[key]


def _reconstructor(cls, base, state):
    """``copyreg._reconstructor`` for stand-ins only (protocol-0/1 pickles of plain classes)."""
    if not (isinstance(cls, type) and issubclass(cls, StandIn)):
        raise UnsafePickleError(f"copyreg._reconstructor of {cls!r}")
    return cls()


def _torch_constant(name: str):
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``: named constants, not callables."""
    value = getattr(torch, name, None)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names listed in this module (plus ``extra``)."""

    extra: dict = {}
    source = "a pickle"

    def find_class(self, module: str, name: str):
        # Protocol 2 pickles spell some modules in Python 2's names, as pickle's own fix_imports maps them.
        module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)
        if (module, name) in self.extra:
            return self.extra[module, name]
        if _ALLOWED.get((module, name)) is not None:
            return _ALLOWED[module, name]
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor
        if (module, name) == ("builtins", "object"):
            return object
        if (module, name) == ("_codecs", "encode"):  # how protocol 2 spells a bytes literal
            return _encode
        if module == "torch" and _torch_constant(name) is not None:
            return _torch_constant(name)
        if module.split(".")[0] in STAND_IN_MODULES:
            return stand_in(module, name)
        raise UnsafePickleError(
            f"{self.source} names {module}.{name}, which could run code when loaded, so megatron_lite refuses it. "
            f"Only tensors, containers, numbers, strings and Megatron's argument types are read from Megatron "
            f"checkpoints; re-save the checkpoint with Megatron-LM itself if it was modified.")


def _encode(text: str, encoding: str = "latin1") -> bytes:
    if not isinstance(text, str):
        raise UnsafePickleError("_codecs.encode of a non-string")
    return text.encode(encoding)


def restricted_pickle_module(source: str, extra: dict | None = None) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load`` whose Unpickler is restricted; ``source`` names the file in errors."""
    module = types.ModuleType("megatron_lite_restricted_pickle")
    module.Unpickler = type("Unpickler", (RestrictedUnpickler,), {"source": source, "extra": extra or {}})
    module.load = lambda file, **kwargs: module.Unpickler(file, **kwargs).load()
    module.__name__ = "megatron_lite_restricted_pickle"
    return module


def load_torch_file(path: str, extra: dict | None = None):
    """``torch.load`` of a Megatron file (on CPU) through the restricted unpickler."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=restricted_pickle_module(path, extra))
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(f"{path} is not a readable torch.save file: {error}") from error


def load_pickle_file(path: str, extra: dict | None = None):
    """A plain pickle (``torch.distributed.checkpoint``'s ``.metadata``) through the restricted unpickler."""
    with open(path, "rb") as f:
        unpickler = restricted_pickle_module(path, extra).Unpickler(f)
        return unpickler.load()
