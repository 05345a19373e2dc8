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

The training data is compared by content, not by path: :func:`dataset_fingerprint` is saved in
every checkpoint, so a dataset moved elsewhere resumes and another one of the same size is refused.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

SCHEDULE = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule", "optim.weight_decay",
            "trainer.max_steps")
ALLOWABLE = frozenset(SCHEDULE + ("trainer.global_batch_size", "optim.clip_grad"))
FREE = frozenset({
    "output_dir", "trainer.max_steps", "trainer.micro_batch_size", "trainer.log_every", "trainer.eval_every",
    "trainer.eval_batches", "trainer.num_threads", "trainer.progress_bar", "trainer.peak_tflops",
    "trainer.preempt_exit_code",
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


def compare(checkpoint: Path, saved: dict, new: dict, allow: list[str], saved_data: str | None,
            new_data: str, *, allow_hint: str = ALLOW_HINT, restart_hint: str = RESTART_HINT
            ) -> dict[str, tuple[Any, Any]]:
    """The keys that change from ``saved`` (the checkpoint's config) to ``new``, once each is cleared.

    ``saved_data``/``new_data`` are the dataset fingerprints (None: a checkpoint from before they
    were recorded, then ``data.path`` is compared by name). ``allow_hint`` (with ``{key}``) and
    ``restart_hint`` (with ``{checkpoint}``) say how the front door allows a key and starts afresh.

    Raises:
        ResumeRefused: the first key that may not change (model keys first), with both values and what to do.
    """
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
    return changed


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
    import json

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
