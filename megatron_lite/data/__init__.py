"""Token data: Megatron-compatible indexed datasets, GPT sampling, blending, mock data and loaders."""
from megatron_lite.data.blended_dataset import BlendedDataset
from megatron_lite.data.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron_lite.data.dataset_builder import build_train_valid_test_datasets, parse_data_path, parse_split
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megatron_lite.data.mock_dataset import MockGPTDataset

__all__ = ["BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetBuilder", "IndexedDatasetError",
           "MegatronPretrainingSampler", "MockGPTDataset", "build_pretraining_data_loader",
           "build_train_valid_test_datasets", "parse_data_path", "parse_split"]
