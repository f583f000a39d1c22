"""Megatron's pickles are read with a restricted unpickler: data loads, code never runs."""
import argparse
import collections
import enum
import os
import pickle
import sys
import types

import pytest
import torch

from megatron_lite.interop.megatron.safe_unpickle import (StandIn, UnsafePickleError, load_pickle_file,
                                                                load_torch_file, stand_in)


class _RunsCode:
    """A payload: unpickling it would call os.system (create the marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": _RunsCode(marker)}, path)
    with pytest.raises(UnsafePickleError, match=r"system, which could run code"):
        load_torch_file(str(path))
    assert not marker.exists()
    raw = tmp_path / ".metadata"
    raw.write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafePickleError):
        load_pickle_file(str(raw))
    assert not marker.exists()


def test_a_builtin_callable_that_is_not_data_is_refused(tmp_path):
    path = tmp_path / "f.pt"
    path.write_bytes(pickle.dumps(eval))  # the bare name builtins.eval
    with pytest.raises(UnsafePickleError, match="builtins.eval"):
        load_pickle_file(str(path))


def test_tensors_containers_namespace_and_megatron_names_load(tmp_path, monkeypatch):
    # A Megatron enum pickled as Megatron's args hold one; the module exists only while saving.
    module = types.ModuleType("megatron.core.transformer.enums")
    module.AttnBackend = enum.Enum("AttnBackend", {"flash": 1, "fused": 2, "unfused": 3},
                                   module="megatron.core.transformer.enums")
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, attention_backend=module.AttnBackend(3))
    path = tmp_path / "model_optim_rng.pt"
    state = {"model": collections.OrderedDict(w=torch.arange(6.0).reshape(2, 3).to(torch.bfloat16)), "args": args,
             "iteration": 7, "checkpoint_version": 3.0, "extra": {1, 2}, "blob": b"\x00\x01"}
    torch.save(state, path)
    monkeypatch.undo()  # loading must not need the module
    loaded = load_torch_file(str(path))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["model"]["w"].dtype == torch.bfloat16
    assert loaded["args"].num_layers == 2 and loaded["args"].params_dtype == torch.bfloat16
    assert isinstance(loaded["args"].attention_backend, StandIn) and loaded["args"].attention_backend.value == 3
    assert loaded["args"].attention_backend == stand_in("megatron.core.transformer.enums", "AttnBackend")(3)
    assert (loaded["iteration"], loaded["extra"], loaded["blob"]) == (7, {1, 2}, b"\x00\x01")
