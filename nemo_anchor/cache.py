"""The user cache every command shares: ``$NEMO_ANCHOR_CACHE``, else ``~/.cache/nemo-anchor``.

It holds what is derived once per machine: the SmolLM2 directory prepared from its GGUF
(:mod:`nemo_anchor.export.pretrained`) and the fastest matmul rates measured on this CPU
(:mod:`nemo_anchor.training.throughput`).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$NEMO_ANCHOR_CACHE``, else ``~/.cache/nemo-anchor``."""
    configured = os.environ.get("NEMO_ANCHOR_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "nemo-anchor"
