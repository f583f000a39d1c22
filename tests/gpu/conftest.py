import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu needs a CUDA GPU; without one it is skipped, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)
