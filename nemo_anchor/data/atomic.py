"""Write outputs under a temporary name and rename them into place, so a failure leaves nothing partial."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_directory(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; it becomes ``target`` only if the block succeeds.

    Raises:
        ValueError: ``target`` exists and ``overwrite`` is False (checked before any work).
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise ValueError(f"output {target} already exists; remove it or pass overwrite (--overwrite)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.chmod(0o755)  # mkdtemp makes it private
    if target.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, retired / target.name)
        os.replace(tmp, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(tmp, target)


@contextlib.contextmanager
def atomic_file(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; it replaces ``target`` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.chmod(0o644)  # mkstemp makes it private
    os.replace(tmp, target)
