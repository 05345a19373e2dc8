"""Write an output directory all at once: build it under a temporary name, then rename it.

A crash or a bad input part-way through leaves no half-written model directory that a later
``from_pretrained`` would load by mistake.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; on success it becomes ``target``.

    An existing ``target`` is an error unless ``overwrite`` (then it is replaced only once the
    new one is complete). On an exception the staging directory is removed.
    """
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {target} (remove it or pass --overwrite)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
