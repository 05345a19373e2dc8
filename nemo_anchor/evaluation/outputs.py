"""Result files written whole or not at all (:func:`nemo_anchor.atomic.atomic_file`)."""
from __future__ import annotations

import json
from pathlib import Path

from nemo_anchor.atomic import atomic_file


def write_json(path: str | Path, payload) -> None:
    with atomic_file(path) as temporary:
        temporary.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def write_jsonl(path: str | Path, records) -> None:
    with atomic_file(path) as temporary:
        temporary.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def save_figure(figure, path: str | Path) -> None:
    """Save a matplotlib figure as PNG and close it."""
    import matplotlib.pyplot as plt

    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
