"""What a local Hugging Face model directory holds, and errors that name what is wrong with one.

Shared by every command that reads one (``import-hf``, ``eval --hf``, ``probe --hf``,
``model.init_from_hf``): a directory without ``config.json`` is named as not being a Hugging Face
model directory, and a weights file that cannot be read (truncated, not safetensors) is named
instead of surfacing as a bare ``SafetensorError``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

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


def read_hf_tensors(path: str | os.PathLike, names: Optional[set[str]] = None) -> dict:
    """The tensors of the weights files of HF directory ``path`` (safetensors, else ``pytorch_model*.bin``),
    all or those in ``names``, as stored: read directly, so nothing is initialised, dropped or reshaped.

    Raises:
        ValueError: no weights file, or one that cannot be read (named).
    """
    import torch
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"{path}: no weights ({' or '.join(WEIGHTS_PATTERNS)}) next to {CONFIG_FILE}")
    tensors = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as handle:
                    tensors.update({name: handle.get_tensor(name) for name in handle.keys()
                                    if names is None or name in names})
            else:
                loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                tensors.update({name: t for name, t in loaded.items() if names is None or name in names})
        except Exception as error:  # noqa: BLE001 - the Rust reader and unpickling raise their own types
            raise _unreadable(file, error) from None
    return tensors


def _unreadable(file: Path, error: BaseException) -> ValueError:
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return ValueError(f"{file}: cannot read the weights ({type(error).__name__}: {first_line})")


def hf_weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the weights of HF directory ``path``, from the safetensors headers
    only (``pytorch_model*.bin`` files are memory-mapped)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return {name: tuple(tensor.shape) for name, tensor in read_hf_tensors(path).items()}
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
        except Exception as error:  # noqa: BLE001
            raise _unreadable(file, error) from None
    return shapes
