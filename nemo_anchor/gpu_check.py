"""The parts of ``scripts/gpu_check.py`` that need no GPU: layouts, the tolerance rule, work counts, tables.

- :func:`conformance_cases` plans the packed layouts (``attention.layout.lognormal_documents``);
- :func:`low_precision_attention` is the "plain low-precision PyTorch implementation" of the
  acceptance rule, and :func:`compare` applies the rule (flash-attn's own): a backend's error
  against the fp32 reference may be at most twice that implementation's, plus a small atol;
- :func:`attention_tflops` rates the useful work of a mask (``PackLayout.kept_pairs``);
- :func:`markdown_report` and :func:`failure_lines` render a results dict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from nemo_anchor.attention.layout import lognormal_documents, query_blocks
from nemo_anchor.attention.reference import dense_mask

# What the GPU suite's processes import from outside the standard library and this package, and where the lent
# GPU machine gets each (../shared/gpu/README.md): its image, or the wheels ../shared/gpu/fetch_wheels.sh lays out
# in .whl/. scripts/gpu_suite.py imports them all up front; tests/test_gpu_suite.py records every import our
# code makes in a --cpu-smoke run of the suite and fails on one missing here. antlr4 (omegaconf's parser) and
# psutil (Megatron's checkpoint writer) are imported by those packages, not by ours, and come as wheels too.
IMAGE, WHEELS = "its image", "the wheels of ../shared/gpu/fetch_wheels.sh (.whl/)"
SUITE_PACKAGES = {
    "torch": IMAGE, "numpy": IMAGE, "tokenizers": IMAGE, "tqdm": IMAGE,
    "megatron.core": WHEELS, "omegaconf": WHEELS, "antlr4": WHEELS, "xxhash": WHEELS, "psutil": WHEELS,
}
# What the parts import where it is there and judge themselves where it is not: the preflight says it is absent
# without failing (a CPU has no triton; on CUDA the paths section's merge row is a FAIL naming it).
SUITE_OPTIONAL_PACKAGES = {"triton": IMAGE + " (every CUDA torch wheel brings it)"}
ATOL = 1e-3  # relative to max(1, |reference|): the "small atol" of the acceptance rule
FLOPS_PER_PAIR_FORWARD = 4  # per head and head_dim unit: q.k and p.v, a multiply and an add each
BACKWARD_FACTOR = 2.5  # forward+backward = 3.5x forward, FlashAttention's convention


def environment() -> dict:
    """The date, the device and the attention libraries this process finds (the header of every report)."""
    import datetime
    import inspect

    from nemo_anchor import gpu

    kernel, reason = gpu.torch_varlen_attn()
    installed = {name: "yes" if found is not None else why for name, (found, why) in (
        ("flash-attn 2", gpu.flash_attn_varlen_func()), ("FlashAttention-3", gpu.flash_attn_3_varlen_func()),
        ("FlashAttention-4", gpu.flash_attn_4_varlen_func()), ("Transformer Engine", gpu.transformer_engine_pytorch()))}
    cuda = torch.cuda.is_available()
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "gpus": torch.cuda.device_count(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else "-",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "varlen_attn": f"varlen_attn{inspect.signature(kernel)}" if kernel else reason, **installed}


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device can run kernels, else why not (one line)."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        return f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {built})"
    return None


@dataclass(frozen=True)
class Case:
    """One conformance problem: a packed layout, a mask mode and head shapes."""

    name: str
    doc_bounds: tuple[int, ...]
    window_bounds: tuple[int, ...]
    mode: str
    heads: int
    kv_heads: int
    head_dim: int
    q_offset: int
    q_len: int
    seed: int

    @property
    def total(self) -> int:
        return self.doc_bounds[-1]


def _with_one_token_documents(bounds: tuple[int, ...], rng: np.random.Generator, count: int) -> tuple[int, ...]:
    """``bounds`` with ``count`` extra 1-token documents cut from the starts of random documents."""
    inner = set(bounds)
    for start in rng.choice(np.array(bounds[:-1]), size=min(count, len(bounds) - 1), replace=False):
        if start + 1 < bounds[-1]:
            inner.add(int(start) + 1)
    return tuple(sorted(inner))


def _windows(bounds: tuple[int, ...], total: int, count: int) -> tuple[int, ...]:
    """``count`` windows cut at the document boundaries nearest to equal shares of ``total``."""
    cuts = {min(bounds, key=lambda b: abs(b - total * i // count)) for i in range(1, count)}
    return tuple(sorted({0, total} | (cuts - {0, total})))


HEAD_SHAPES = ((8, 2, 128), (4, 4, 64))  # (query heads, key/value heads, head_dim): grouped-query and plain


def conformance_cases(total: int, seed: int = 0, head_shapes=HEAD_SHAPES) -> list[Case]:
    """Random packed layouts of ``total`` tokens for every mode.

    Each head shape of ``head_shapes``, 1-token documents, one to four windows, and a
    context-parallel style query chunk (``q_offset``, first head shape). All share ``total`` so
    that compiled kernels (flex) see few distinct shapes.
    """
    rng = np.random.default_rng(seed)
    docs = lognormal_documents(total, seed, mean_tokens=total / 8)
    docs_short = _with_one_token_documents(lognormal_documents(total, seed + 1, mean_tokens=total / 16), rng, 4)
    layouts = {  # name -> (doc_bounds, window_bounds)
        "1 window": (docs, (0, total)),
        "4 windows, 1-token docs": (docs_short, _windows(docs_short, total, 4)),
        "2 windows, BOS-only first doc": ((0, 1, *[b for b in docs_short if b > 1]), _windows(docs_short, total, 2)),
    }
    cases = []
    for mode in ("anchor", "intra_doc", "full"):
        for layout, (doc_bounds, window_bounds) in layouts.items():
            for h, hkv, d in head_shapes:
                cases.append(Case(f"{layout}, {h}/{hkv} heads, d={d}", doc_bounds, window_bounds, mode, h, hkv, d,
                                  0, total, seed=len(cases)))
        doc_bounds, window_bounds = layouts["4 windows, 1-token docs"]
        h, hkv, d = head_shapes[0]
        cases.append(Case(f"4 windows, queries [T/2, 3T/4) (a context-parallel chunk), {h}/{hkv} heads, d={d}",
                          doc_bounds, window_bounds, mode, h, hkv, d, total // 2, total // 4, seed=len(cases)))
    return cases


def case_blocks(case: Case):
    return query_blocks(case.doc_bounds, case.window_bounds, case.mode, case.q_offset, case.q_len)


def low_precision_attention(q, k, v, blocks, q_offset: int, scale: float) -> torch.Tensor:
    """Plain PyTorch attention in the inputs' dtype (scores, softmax output and p @ v rounded to it).

    The baseline of the acceptance rule: what a straightforward bf16/fp16 implementation errs by.
    ``q [Tq, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``[Tq, Hq, D]``; differentiable; O(Tq * T * Hq) memory.
    """
    group = q.shape[1] // k.shape[1]
    keys, values = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores = scores.masked_fill(~dense_mask(blocks, q_offset, k.shape[0], q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.float().softmax(-1).to(q.dtype), values)


def compare(name: str, actual: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor) -> dict:
    """flash-attn's acceptance rule for one tensor: ``|actual - ref| <= 2 |baseline - ref| + atol`` (max norms)."""
    ref = reference.float()
    error = (actual.float() - ref).abs().max().item()
    baseline_error = (baseline.float() - ref).abs().max().item()
    atol = ATOL * max(1.0, ref.abs().max().item())
    bound = 2 * baseline_error + atol
    return {"tensor": name, "error": error, "baseline_error": baseline_error, "bound": bound,
            "ok": bool(math.isfinite(error) and error <= bound)}


def attention_tflops(pairs: int, heads: int, head_dim: int, seconds: float, backward: bool) -> float:
    """Achieved TFLOP/s counting only the kept pairs."""
    flops = FLOPS_PER_PAIR_FORWARD * head_dim * heads * pairs * (1 + BACKWARD_FACTOR * backward)
    return flops / seconds / 1e12


def table(header: list[str], rows: list[list]) -> str:
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.0f}"
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


TRAINING_SECTIONS = {
    "training": "Training (small Llama-shaped model, bf16, the trainer's engine)",
    "cp2": "Context parallel 2 (torchrun, two GPUs)",
}


def markdown_report(results: dict, title: str = "gpu_check") -> str:
    """The results of ``scripts/gpu_check.py`` as markdown: a header, one table per section, the failures."""
    out = [f"# {title}", ""]
    if results.get("skipped"):
        return "\n".join(out + [f"Skipped: {results['skipped']}", ""])
    env = results.get("environment", {})
    out += [", ".join(f"{k}: {v}" for k, v in env.items()), ""]
    out += section_tables(results)
    failures = failure_lines(results)
    out += ["## Failures", ""] + ([f"- {line}" for line in failures] or ["none"]) + [""]
    return "\n".join(out)


def section_tables(results: dict) -> list[str]:
    """Markdown lines: one table per section of ``results`` that ``scripts/gpu_check.py`` writes."""
    out = []
    conformance = results.get("conformance", [])
    if conformance:
        out += ["## Conformance (error vs fp32 reference; bound = 2 x plain low-precision error + atol)", ""]
        rows = []
        for r in conformance:
            if "tensors" in r:
                worst = max(r["tensors"], key=lambda t: t["error"] / t["bound"] if t["bound"] else math.inf)
                status = "ok" if all(t["ok"] for t in r["tensors"]) else f"FAIL ({worst['tensor']})"
                rows.append([r["backend"], r["dtype"], r["mode"], r["case"], status,
                             worst["tensor"], worst["error"], worst["bound"]])
            else:
                rows.append([r["backend"], r.get("dtype", "-"), r.get("mode", "-"), r.get("case", "-"),
                             r["status"], "-", "-", "-"])
        out += [table(["backend", "dtype", "mode", "case", "status", "worst", "error", "bound"], rows), ""]
    paths = results.get("paths", [])
    if paths:
        out += ["## The anchor's paths (issue 45; SKIP: the check needs CUDA)", "",
                table(["check", "status", "backend", "detail"],
                      [[r["check"], r["status"], r.get("backend", "-"), r.get("detail", "-")] for r in paths]), ""]
    speed = results.get("speed", [])
    if speed:
        out += ["## Speed (one packed window; TFLOP/s count kept pairs only; x SDPA = SDPA time / time)", ""]
        rows = [[r["tokens"], r.get("documents", "-"), r["method"], r["status"], r.get("fwd_ms", "-"),
                 r.get("fwd_tflops", "-"), r.get("speedup_fwd", "-"), r.get("fwd_bwd_ms", "-"),
                 r.get("fwd_bwd_tflops", "-"), r.get("speedup_fwd_bwd", "-"), r.get("peak_gib", "-")] for r in speed]
        out += [table(["tokens", "docs", "method", "status", "fwd ms", "fwd TFLOP/s", "x SDPA fwd", "fwd+bwd ms",
                        "fwd+bwd TFLOP/s", "x SDPA fwd+bwd", "peak GiB (allocated)"], rows), ""]
    for section, heading in TRAINING_SECTIONS.items():
        training = results.get(section, [])
        if not training:
            continue
        out += [f"## {heading}", "", "MFU counts model FLOPs only; HFU adds recomputed work (none here).", ""]
        rows = [[r["run"], r["status"], r.get("backend", "-"), r.get("tokens_per_s", "-"),
                 r.get("tflops_per_gpu", "-"), r.get("mfu", "-"), r.get("hfu", "-"), r.get("peak_gib", "-"),
                 r.get("loss_first", "-"), r.get("loss_last", "-"), r.get("loss_falling", "-")] for r in training]
        out += [table(["run", "status", "attention backend", "tokens/s", "model TFLOP/s per GPU", "MFU", "HFU",
                        "peak GiB", "first loss", "last loss", "loss falling"], rows), ""]
    return out


def failure_lines(results: dict) -> list[str]:
    """One line per failed check of a results dict."""
    lines = []
    for r in results.get("conformance", []):
        if "tensors" in r:
            for t in r["tensors"]:
                if not t["ok"]:
                    lines.append(f"conformance {r['backend']} {r['dtype']} {r['mode']} [{r['case']}] {t['tensor']}: "
                                 f"error {t['error']:.3g} > bound {t['bound']:.3g}")
        elif r["status"].startswith("FAIL"):
            lines.append(f"conformance {r['backend']} {r.get('dtype', '')} {r.get('mode', '')} "
                         f"[{r.get('case', '')}]: {r['status']}")
    for r in results.get("paths", []):
        if r["status"].startswith("FAIL"):
            lines.append(f"paths {r['check']}: {r['status']}: {r.get('detail', '')}")
    for section in ("speed", *TRAINING_SECTIONS):
        for r in results.get(section, []):
            if r["status"].startswith("FAIL"):
                what = f"{r['tokens']} tokens {r['method']}" if section == "speed" else r["run"]
                lines.append(f"{section} {what}: {r['status']}")
    return lines
