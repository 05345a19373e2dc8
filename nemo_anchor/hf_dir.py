"""What a local Hugging Face model directory holds, and errors that name what is wrong with one.

Shared by every command that reads one (``import-hf``, ``eval --hf``, ``probe --hf``,
``model.init_from_hf``): a directory without ``config.json`` is named as not being a Hugging Face
model directory, and a weights file that cannot be read (truncated, not safetensors) is named
instead of surfacing as a bare ``SafetensorError``.
"""
from __future__ import annotations

import os
from pathlib import Path

CONFIG_FILE = "config.json"
WEIGHTS_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def is_hf_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def require_hf_dir(path: str | os.PathLike) -> Path:
    """``path`` when it holds ``config.json``; otherwise ValueError saying what was expected."""
    path = Path(path)
    if not is_hf_dir(path):
        what = "does not exist" if not path.exists() else f"has no {CONFIG_FILE}"
        raise ValueError(f"{path} is not a Hugging Face model directory ({what}): expected {CONFIG_FILE} and the "
                         f"weights ({' or '.join(WEIGHTS_PATTERNS)})")
    return path


def load_error(path: str | os.PathLike, error: BaseException) -> ValueError:
    """A one-line ValueError for a failed ``from_pretrained(path)``, naming the unreadable file when one is."""
    broken = unreadable_weights(Path(path))
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    where = broken if broken is not None else Path(path)
    return ValueError(f"{where}: cannot load the Hugging Face model ({type(error).__name__}: {first_line})")


def unreadable_weights(path: Path) -> Path | None:
    """The first ``*.safetensors`` file of ``path`` whose header or data does not read back, else None."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception:  # noqa: BLE001 - the Rust reader raises its own error types
            return file
    return None
