"""Result files written whole or not at all: each goes to a temporary sibling, then is renamed."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s directory; on success rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(handle)
    try:
        yield Path(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def write_json(path: str | Path, payload) -> None:
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def write_jsonl(path: str | Path, records) -> None:
    with atomic_path(path) as temporary:
        temporary.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def save_figure(figure, path: str | Path) -> None:
    """Save a matplotlib figure as PNG and close it."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
