"""What a resumed run may change: the checkpoint's config against the new one, before anything is written.

Three kinds of keys (dotted names of the run config):

- keys that only say how the run is executed or logged (:data:`FREE`: ``trainer.max_steps``,
  logging, evaluation and save intervals, micro-batch size, recompute, the tensor-, pipeline- and
  context-parallel sizes, ...;
  and ``model.init_from_hf``, which a resume does not read) change on resume; the change is
  reported in one line;
- keys Megatron-LM users change on purpose mid-run (:data:`ALLOWABLE`: the LR schedule,
  ``trainer.global_batch_size``, ``optim.clip_grad``) change only when listed in
  ``checkpoint.allow_change`` (``nemo-anchor train --allow-change optim.lr,...``), and are then
  applied for real: any LR-schedule key listed takes the whole schedule (lr, min_lr, warmup,
  decay style and length, weight decay) from the new config, as Megatron-LM's
  ``--override-opt-param-scheduler`` does; otherwise the checkpoint's schedule continues
  (``--use-checkpoint-opt-param-scheduler``, Megatron-LM's default);
- every other key (the model and its attention, ``model.seq_length``, the data, seed, precision,
  optimizer betas...) alters the run: a change is refused naming the key and both values.

The training data is compared by content, not by path: :func:`data_record` is saved in every
checkpoint, so a dataset moved elsewhere resumes and another one of the same size is refused. It holds
the dataset's fingerprint (its metadata, which holds pack's digest of every file) and where its files
were, with their sizes and modification times: when any of these changed, the files are read again and
compared with pack's digests (the time it took is reported), so data rewritten in place is refused.

NeMo's and Bridge's front doors keep the same record with their checkpoints (:func:`run_record`), built
here from their configs, under the keys of ``nemo-anchor train``'s config.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

SCHEDULE = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule", "optim.weight_decay",
            "trainer.max_steps")
ALLOWABLE = frozenset(SCHEDULE + ("trainer.global_batch_size", "optim.clip_grad"))
FREE = frozenset({
    "output_dir", "trainer.max_steps", "trainer.micro_batch_size", "trainer.log_every", "trainer.eval_every",
    "trainer.eval_batches", "trainer.num_threads", "trainer.progress_bar", "trainer.peak_tflops",
    "trainer.preempt_exit_code", "trainer.distributed_timeout_minutes",
    "checkpoint.save_every", "checkpoint.keep_last", "checkpoint.resume", "checkpoint.allow_change",
    "checkpoint.verify", "checkpoint.async_save",
    "data.valid_path", "model.recompute", "model.recompute_num_layers", "model.context_parallel_size",
    "model.cp_comm_type", "model.attention_backend",
    # checkpoints are in model space (nemo_anchor.training.optimizer_state): any layout resumes them
    "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
    "model.init_from_hf",  # read by fresh runs only: a resume takes its weights from the checkpoint
})
DATA_KEY = "data.path"


class ResumeRefused(ValueError):
    """A resume that would change the run (the message names the key and both values)."""


def check_allow_list(allow: list[str]) -> None:
    """ValueError naming an entry of ``checkpoint.allow_change`` that cannot be allowed."""
    for key in allow:
        if key not in ALLOWABLE:
            raise ValueError(f"checkpoint.allow_change: {key!r} cannot change on resume; the keys that can are "
                             f"{', '.join(sorted(ALLOWABLE))}")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return flat


ALLOW_HINT = "pass --allow-change {key} (config: checkpoint.allow_change=[{key}])"
RESTART_HINT = "train into a new output_dir (model.init_from_hf={checkpoint} starts from its weights)"


def compare(checkpoint: Path, saved: dict, new: dict, allow: list[str], saved_data: dict | str | None,
            new_data: dict, *, allow_hint: str = ALLOW_HINT, restart_hint: str = RESTART_HINT,
            report: Callable[[str], None] | None = None) -> dict[str, tuple[Any, Any]]:
    """The keys that change from ``saved`` (the checkpoint's config) to ``new``, once each is cleared.

    ``saved_data``/``new_data`` are :func:`data_record` s (a checkpoint of an earlier version saved the
    fingerprint alone, or nothing: then ``data.path`` is compared by name). When the data files moved or
    changed size or modification time, they are read again and compared with their digests, and ``report``
    (rank 0's print by default) says how long that took. ``allow_hint`` (with ``{key}``) and ``restart_hint``
    (with ``{checkpoint}``) say how the front door allows a key and starts afresh.

    Raises:
        ResumeRefused: the first key that may not change (model keys first), with both values and what to do;
            or data files that differ from their digests, naming the first.
    """
    saved_files = saved_data.get("files") if isinstance(saved_data, dict) else None
    saved_data, new_data, new_files = _fingerprint(saved_data), _fingerprint(new_data), new_data["files"]
    old, now = flatten(saved), flatten(new)
    changed = {key: (old.get(key), now.get(key)) for key in old.keys() | now.keys() if old.get(key) != now.get(key)}
    # the data compared by content: moved is the same (the new path is reported), another of its size is not
    moved = saved_data is not None and saved_data == new_data
    if saved_data is not None and saved_data != new_data:
        changed[DATA_KEY] = (old.get(DATA_KEY), now.get(DATA_KEY))
    changed = {key: changed[key] for key in sorted(changed, key=_order)}
    for key, (before, after) in changed.items():
        if key in FREE or (key in ALLOWABLE and key in allow) or (key == DATA_KEY and moved):
            continue
        if key == DATA_KEY:
            fingerprints = "" if saved_data is None else f"; fingerprint {saved_data[:12]} -> {new_data[:12]}"
            raise ResumeRefused(
                f"cannot resume {checkpoint}: data.path={after} is not the packed dataset it was trained on "
                f"(data.path was {before}{fingerprints}): resume with that dataset, or "
                f"{restart_hint.format(checkpoint=checkpoint)}")
        if key in ALLOWABLE:
            hint = f"to resume with the new value on purpose, {allow_hint.format(key=key)}, or set {key}={before!r}"
        else:
            hint = f"it changes the run: resume with {key}={before!r}, or {restart_hint.format(checkpoint=checkpoint)}"
        raise ResumeRefused(f"cannot resume {checkpoint}: {key} was {before!r}, the new config has {after!r}; {hint}")
    if saved_data is not None and saved_files != new_files:
        _check_data_files(checkpoint, new_files, restart_hint, report)
    return changed


def _fingerprint(data: dict | str | None) -> str | None:
    return data.get("fingerprint") if isinstance(data, dict) else data


def _check_data_files(checkpoint: Path, files: dict, restart_hint: str, report: Callable[[str], None] | None) -> None:
    """The data files, changed (path, size or modification time) since ``checkpoint``, against pack's digests."""
    import torch.distributed as dist

    from nemo_anchor.checksums import broadcast_from_first, say_once, verify_digests
    from nemo_anchor.data.layout import METADATA_FILE

    root = Path(files["path"])
    recorded = json.loads((root / METADATA_FILE).read_text()).get("checksums")
    if not isinstance(recorded, dict):
        return  # packed before digests were recorded: its fingerprint covered the ends of its tokens
    started = time.monotonic()
    first = not dist.is_initialized() or dist.get_rank() == 0
    problems = broadcast_from_first(verify_digests(root, recorded) if first else None)  # rank 0 reads them
    if problems:
        raise ResumeRefused(f"cannot resume {checkpoint}: {problems[min(problems)]}: resume with the data it was "
                            f"trained on, or {restart_hint.format(checkpoint=checkpoint)}")
    size = sum(entry[0] for entry in recorded.values())
    (report or say_once)(f"data.path={root}: its files moved or changed size or modification time since {checkpoint}"
                         f"; read {len(recorded)} files ({size / 1e9:.3g} GB) again in "
                         f"{time.monotonic() - started:.2f} s: they match the digests pack recorded")


def data_record(path: str | Path) -> dict:
    """What a checkpoint records of its training data: the dataset's :func:`dataset_fingerprint` and where its
    files were, with their sizes and modification times (``{"path": ..., file: [bytes, mtime_ns]}``)."""
    from nemo_anchor.data.layout import METADATA_FILE

    root = Path(path).resolve()
    recorded = json.loads((root / METADATA_FILE).read_text()).get("checksums")
    names = sorted(recorded) if isinstance(recorded, dict) else []
    files: dict[str, Any] = {"path": str(root)}
    for name in names:
        stat = (root / name).stat() if (root / name).is_file() else None
        files[name] = [stat.st_size, stat.st_mtime_ns] if stat else None
    return {"fingerprint": dataset_fingerprint(root), "files": files}


OPTIM_KEYS = ("lr", "min_lr", "weight_decay", "clip_grad", "beta1", "beta2", "eps", "warmup_steps", "schedule")


def run_record(megatron_config, *, data_path, valid_path, global_batch_size: int, micro_batch_size: int,
               max_steps: int, optim: dict, default_architecture: str | None = None) -> dict:
    """The record NeMo's and Bridge's front doors keep with their checkpoints and :func:`compare` on resume:
    ``{"config": the run under nemo-anchor train's keys, "data": data_record}``.

    ``megatron_config`` is the model's (Megatron-Core ``TransformerConfig`` fields); ``optim`` holds
    :data:`OPTIM_KEYS` (a door without one passes None).
    """
    from nemo_anchor.convert.megatron_config import model_config_from_megatron

    model = dataclasses.asdict(model_config_from_megatron(megatron_config, default_architecture=default_architecture))
    model.update(tensor_model_parallel_size=getattr(megatron_config, "tensor_model_parallel_size", 1),
                 context_parallel_size=getattr(megatron_config, "context_parallel_size", 1))
    unknown = set(optim) - set(OPTIM_KEYS)
    if unknown:
        raise ValueError(f"run_record: unknown optim keys {sorted(unknown)}")
    config = {
        "model": model,
        "data": {"path": str(data_path), "valid_path": valid_path and str(valid_path)},
        "trainer": {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
                    "max_steps": max_steps, "precision": "bf16" if megatron_config.bf16 else "fp32"},
        "optim": {key: optim.get(key) for key in OPTIM_KEYS},
    }
    return {"config": config, "data": data_record(data_path)}


def overrides_schedule(changed: dict, allow: list[str]) -> bool:
    """Whether the new config's LR schedule replaces the checkpoint's (Megatron's override_opt_param_scheduler)."""
    return any(key in changed for key in SCHEDULE if key in allow)


def _order(key: str) -> tuple[int, str]:
    """Model keys first (the most telling refusal), then data, the rest alphabetically."""
    return (0 if key.startswith("model.") else 1 if key.startswith("data.") else 2, key)


def dataset_fingerprint(path: str | Path) -> str:
    """SHA-256 of what identifies a packed dataset: its metadata, statistics and segment index. The metadata
    ``pack`` writes holds the XXH3-128 digest of every file of the split, computed from every byte as it was
    written, so two packings differing anywhere differ here; for a dataset packed before those were recorded,
    the first and last windows of its tokens stand in."""
    from nemo_anchor.data.layout import METADATA_FILE, SEGMENT_STARTS_FILE, STATS_FILE, TOKENS_FILE

    root = Path(path)
    digest = hashlib.sha256()
    for name in (METADATA_FILE, STATS_FILE, SEGMENT_STARTS_FILE):
        file = root / name
        digest.update(name.encode())
        digest.update(file.read_bytes() if file.is_file() else b"-")
    if "checksums" in json.loads((root / METADATA_FILE).read_text()):
        return digest.hexdigest()
    tokens = root / TOKENS_FILE
    size = tokens.stat().st_size
    with open(tokens, "rb") as handle:
        digest.update(handle.read(1 << 16))
        handle.seek(max(0, size - (1 << 16)))
        digest.update(handle.read(1 << 16))
    return digest.hexdigest()
