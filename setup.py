"""Installs megatron_lite; the top-level kernels/ folder becomes megatron_lite.kernels.

A top-level ``kernels`` module would collide with Hugging Face's ``kernels`` package
(transformers imports it when present), hence the ``package_dir`` mapping.
"""
from setuptools import find_packages, setup

packages = find_packages(include=["megatron_lite", "megatron_lite.*"])
packages += ["megatron_lite.kernels"]

setup(
    name="megatron_lite",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training that reads in an afternoon",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"megatron_lite.kernels": "kernels"},
    install_requires=["torch>=2.3", "numpy", "sentencepiece", "regex"],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "transformers", "tokenizers", "safetensors"],
    },
)
