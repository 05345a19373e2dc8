"""One variant's measurements, each over its last K checkpoints (paper, Section 4.2).

Every metric is ``{"label", "better", "values", "mean", "std", "over"}``: ``values`` per
checkpoint (``over = "checkpoints"``), or per logged training step for tokens/s
(``over = "steps"``); ``std`` is the sample standard deviation (None for a single value), the
uncertainty the report compares differences with.

- ``valid_loss``: the trainer's held-out loss (data.valid_path, the variant's own attention);
- ``heldout_ppl`` and ``ppl@A-B``: perplexity of the exported model on the held-out windows as
  plain causal LM, overall and per target-position bucket (:mod:`nemo_anchor.evaluation.perplexity`);
- ``ruler@L``, ``ruler_avg``: RULER-style scores (%, mean over tasks) per length and over lengths;
- ``d_logit@T``: the BF16 probe's ``D_logit`` (Eq. 5) at its longest length (:mod:`nemo_anchor.analysis`);
- ``tokens_per_s``: training throughput.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from nemo_anchor.analysis.probe import PAPER_LENGTHS, ProbeSettings, run_probe
from nemo_anchor.evaluation.models import parse_dtype
from nemo_anchor.evaluation.runner import EvalSettings, evaluate_paths
from nemo_anchor.run_dir import RunDir


@dataclass(frozen=True)
class Measurement:
    """What is measured on every variant, identically."""

    eval: EvalSettings
    probe: ProbeSettings | None
    last_k: int
    dtype: str
    device: str
    valid_dir: str  # held-out packed windows (probe sequences)

    def key(self, steps: list[int]) -> dict:
        """Identifies a measurement, as its JSON reads back: a stored result with another key is measured again."""
        return json.loads(json.dumps({"eval": asdict(self.eval), "probe": asdict(self.probe) if self.probe else None,
                                      "steps": steps, "dtype": self.dtype, "device": self.device}))


def probe_settings(sequences: int, sequence_length: int, seq_length: int) -> ProbeSettings | None:
    """The bf16 variant only, D_logit at the paper's lengths up to the training window.

    Only ``Δ1 = 0`` is shifted: ``D_logit`` needs nothing else, and each further shift is one more
    pass of the model in bf16 (minutes each for a 135M model on a CPU).
    """
    if sequences == 0:
        return None
    lengths = tuple(length for length in PAPER_LENGTHS if length <= seq_length) or (seq_length,)
    return ProbeSettings(num_sequences=sequences, sequence_length=sequence_length, shifts=(0,), lengths=lengths,
                         max_length=seq_length, variants=("bf16",))


def summary(label: str, better: str, values: list[float], over: str = "checkpoints") -> dict:
    return {"label": label, "better": better, "values": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None, "over": over}


def measure_variant(output_dir: str | Path, steps: list[int], measurement: Measurement) -> dict:
    """``{"steps", "metrics": {key: summary}, "curves": {"loss", "valid_loss"}}`` of one training run,
    its checkpoints at ``steps`` evaluated one at a time."""
    run = RunDir(output_dir)
    models = [(run.checkpoint(step), step) for step in steps]
    report, _ = evaluate_paths(models, measurement.eval, dtype=parse_dtype(measurement.dtype),
                               device=measurement.device)
    runs = report["runs"]
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    metrics = {"valid_loss": summary("held-out loss (own mask)", "lower", _valid_losses(rows, steps, run))}
    ppl = [run_["perplexity"] for run_ in runs]
    metrics["heldout_ppl"] = summary("held-out ppl", "lower", [_overall_perplexity(p) for p in ppl])
    for bucket, (start, end) in enumerate(zip(ppl[0]["starts"], ppl[0]["ends"])):
        metrics[f"ppl@{start}-{end - 1}"] = summary(f"ppl pos {start}-{end - 1}", "lower",
                                                    [p["perplexity"][bucket] for p in ppl])
    if measurement.eval.tasks:
        lengths = list(runs[0]["ruler_average"])
        for length in lengths:
            metrics[f"ruler@{length}"] = summary(f"RULER@{length} (%)", "higher",
                                                 [r["ruler_average"][length] for r in runs])
        metrics["ruler_avg"] = summary("RULER avg (%)", "higher",
                                       [statistics.fmean(r["ruler_average"].values()) for r in runs])
    if measurement.probe is not None:
        probed = [run_probe(path, [measurement.valid_dir], measurement.probe, device=measurement.device)[0]["bf16"]
                  for path, _ in models]
        longest = max(probed[0]["D_logit"], key=int)
        metrics[f"d_logit@{longest}"] = summary(f"D_logit@{longest} (bf16)", "lower",
                                                [p["D_logit"][longest] for p in probed])
    speeds = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
    metrics["tokens_per_s"] = summary("tokens/s", "higher", speeds[1:] if len(speeds) > 1 else speeds, over="steps")
    curves = {"loss": [[row["step"], row["loss"]] for row in rows if "loss" in row],
              "valid_loss": [[row["step"], row["valid_loss"]] for row in rows if "valid_loss" in row]}
    return {"steps": steps, "metrics": metrics, "curves": curves, "ruler": [r["ruler"] for r in runs]}


def _valid_losses(rows: list[dict], steps: list[int], run: RunDir) -> list[float]:
    logged = {row["step"]: row["valid_loss"] for row in rows if "valid_loss" in row}
    missing = [step for step in steps if step not in logged]
    if missing:
        raise ValueError(f"{run.metrics} has no valid_loss at checkpoint steps {missing} "
                         f"(trainer.eval_every must divide checkpoint.save_every)")
    return [logged[step] for step in steps]


def _overall_perplexity(ppl: dict) -> float:
    """exp of the token-weighted mean loss over every bucket."""
    total = sum(nll * count for nll, count in zip(ppl["nll"], ppl["num_tokens"]))
    return math.exp(total / sum(ppl["num_tokens"]))
