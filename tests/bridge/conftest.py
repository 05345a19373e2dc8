"""Fixtures of the Megatron-Bridge tests (.venv-bridge)."""
import pytest


@pytest.fixture(scope="session")
def pretrain_cli(preloaded):
    """``python -m nemo_anchor.bridge.pretrain``, with Megatron-Bridge imported once (tests/preloaded.py)."""
    return preloaded("nemo_anchor.bridge.pretrain:main", "nemo_anchor.bridge.pretrain")
