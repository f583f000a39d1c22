"""Token data: Megatron-compatible indexed datasets, GPT sampling, blending, mock data and loaders.

The names below are imported on first use, so that ``tools/preprocess_data.py``, which only writes
indexed datasets, starts without PyTorch (the loaders' dependency, and most of a start-up's time).
"""
import importlib

_MODULE_OF = {
    "BlendedDataset": "blended_dataset",
    "GPTDataset": "gpt_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "IndexedDatasetError": "indexed_dataset",
    "MegatronPretrainingSampler": "data_samplers",
    "MockGPTDataset": "mock_dataset",
    "build_pretraining_data_loader": "data_samplers",
    "build_train_valid_test_datasets": "dataset_builder",
    "parse_data_path": "dataset_builder",
    "parse_split": "dataset_builder",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
