"""Evaluate a model, or the last checkpoints of a run, on RULER-style tasks and perplexity."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from nemo_anchor.cpu_bf16 import bf16_matmul_kind, bf16_matmuls_in_fp32
from nemo_anchor.evaluation.corpus import check_token_ids, read_token_windows
from nemo_anchor.evaluation.models import load_model
from nemo_anchor.evaluation.perplexity import perplexity_by_position
from nemo_anchor.evaluation.ruler import TASKS, Sample, Task, generate_samples
from nemo_anchor.evaluation.scoring import postprocess_prediction

RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate.

    ``lengths=None`` means RULER's lengths (4K to 128K) up to the model's ``max_position_embeddings``;
    explicit lengths are used as given. ``max_new_tokens`` overrides every task's generation budget.
    Perplexity is measured only when ``perplexity_data`` names inputs (see ``read_token_windows``).
    """

    tasks: tuple[str, ...] = tuple(TASKS)
    lengths: tuple[int, ...] | None = None
    num_samples: int = 10
    seed: int = 0
    max_new_tokens: int | None = None
    perplexity_data: tuple[str, ...] = ()
    perplexity_length: int = 4096
    perplexity_windows: int = 4
    perplexity_buckets: int = 8
    text_key: str = "text"

    def __post_init__(self):
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; known: {sorted(TASKS)}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.lengths is not None and min(self.lengths, default=1) < 1:
            raise ValueError(f"lengths must be positive, got {list(self.lengths)}")
        if not self.tasks and not self.perplexity_data:
            raise ValueError("nothing to evaluate: no tasks and no perplexity data")

    def lengths_for(self, model) -> list[int]:
        if self.lengths is not None:
            return list(self.lengths)
        limit = getattr(model.config, "max_position_embeddings", None) or max(RULER_LENGTHS)
        return [length for length in RULER_LENGTHS if length <= limit]


def greedy_completion(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding of at most ``max_new_tokens`` tokens after ``prompt`` (KV-cached ``generate``)."""
    from transformers import GenerationConfig

    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def evaluate_model(model, tokenizer, settings: EvalSettings, desc: str = "eval") -> tuple[dict, list[dict]]:
    """Score one model.

    Returns ``(result, predictions)``: ``result`` is ``{"ruler": {task: {str(length): score}},
    "ruler_average": {str(length): mean over tasks}, "perplexity": PositionPerplexity.as_dict() or None}``
    with scores in percent; ``predictions`` has one record per generated sample. All prompts and
    perplexity windows are prepared before decoding starts, so bad settings fail at once.
    """
    prompts = build_prompts(tokenizer, settings, settings.lengths_for(model) if settings.tasks else [])
    windows = None
    if settings.perplexity_data:
        windows = read_token_windows(
            settings.perplexity_data, tokenizer, num_windows=settings.perplexity_windows,
            length=settings.perplexity_length, text_key=settings.text_key,
        )
        check_token_ids(windows, model.config.vocab_size, settings.perplexity_data)
    ruler: dict[str, dict[str, float]] = {}
    predictions = []
    with tqdm(total=len(prompts) * settings.num_samples, desc=desc, unit="sample") as progress:
        for (task, length), samples in prompts.items():
            completions = []
            for index, sample in enumerate(samples):
                completion = greedy_completion(model, tokenizer, sample.prompt, sample.max_new_tokens)
                completions.append(postprocess_prediction(completion))
                predictions.append({
                    "task": task.name, "length": length, "index": index, "prompt_tokens": sample.num_prompt_tokens,
                    "answers": sample.answers, "prediction": completions[-1],
                    "score": task.metric([completions[-1]], [sample.answers]),
                })
                progress.update(1)
            ruler.setdefault(task.name, {})[str(length)] = task.metric(completions, [s.answers for s in samples])
    lengths = sorted({length for _, length in prompts})
    perplexity = None
    if windows is not None:
        perplexity = perplexity_by_position(model, windows, settings.perplexity_buckets).as_dict()
    result = {
        "ruler": ruler,
        "ruler_average": {str(length): _mean(scores[str(length)] for scores in ruler.values()) for length in lengths},
        "perplexity": perplexity,
    }
    return result, predictions


def build_prompts(tokenizer, settings: EvalSettings, lengths: Sequence[int]) -> dict[tuple[Task, int], list[Sample]]:
    """The samples of every (task, length), or one ValueError naming every pair that cannot fit."""
    if settings.tasks and not lengths:
        raise ValueError("no RULER length fits the model's max_position_embeddings; pass lengths explicitly")
    tasks = [TASKS[name] for name in settings.tasks]
    if settings.max_new_tokens is not None:
        tasks = [replace(task, max_new_tokens=settings.max_new_tokens) for task in tasks]
    prompts, problems = {}, []
    for task in tasks:
        for length in lengths:
            try:
                prompts[task, length] = generate_samples(task, tokenizer, length, settings.num_samples, settings.seed)
            except ValueError as error:
                problems.append(str(error))
    if problems:
        raise ValueError("cannot build the requested tasks; use longer lengths or other tasks:\n" + "\n".join(problems))
    return prompts


def evaluate_paths(
    models: Sequence[tuple[str | Path, int | None]],
    settings: EvalSettings,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> tuple[dict, list[dict]]:
    """Evaluate each ``(path, iteration or None)`` in turn and average them (paper, Section 4.2).

    Returns ``({"settings", "runs": [result + model + iteration], "mean": averaged result}, predictions)``.
    """
    if not models:
        raise ValueError("no model to evaluate")
    runs, predictions = [], []
    for path, iteration in models:
        model, tokenizer = load_model(path, dtype=dtype, device=device)
        with bf16_matmuls_in_fp32(dtype, device):
            result, run_predictions = evaluate_model(model, tokenizer, settings, desc=Path(path).name)
        runs.append({"model": str(path), "iteration": iteration, **result})
        predictions += [{"model": str(path), "iteration": iteration, **record} for record in run_predictions]
        del model  # one set of weights in memory at a time
    settings_used = {**asdict(settings), "dtype": str(dtype), "device": device}
    if dtype == torch.bfloat16:
        settings_used["bf16_matmuls"] = bf16_matmul_kind(device)
    report = {"settings": settings_used, "runs": runs, "mean": average_runs(runs)}
    return report, predictions


def average_runs(runs: Sequence[dict]) -> dict:
    """Mean RULER scores over runs; perplexity from the mean per-bucket loss."""
    first = runs[0]
    ruler = {
        task: {length: _mean(run["ruler"][task][length] for run in runs) for length in scores}
        for task, scores in first["ruler"].items()
    }
    averaged = {
        "ruler": ruler,
        "ruler_average": {
            length: _mean(run["ruler_average"][length] for run in runs) for length in first["ruler_average"]
        },
        "perplexity": None,
    }
    if first["perplexity"] is not None:
        nll = [_mean(values) for values in zip(*(run["perplexity"]["nll"] for run in runs))]
        averaged["perplexity"] = {
            **first["perplexity"], "nll": nll, "perplexity": torch.tensor(nll, dtype=torch.float64).exp().tolist(),
        }
    return averaged


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
