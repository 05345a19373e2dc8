"""Check a CUDA machine end to end: backend conformance, attention speed, training steps.

    python scripts/gpu_check.py [--quick] [--output DIR] [--sections ...] [--lengths ...]

1. conformance: every backend that can run (fa3, te, fa4, torch_varlen, flash, flex, reference) against the
   fp32 reference on random packed layouts (anchor, intra_doc, full; grouped-query heads; 1-token
   documents; several windows; a context-parallel query chunk), outputs and q/k/v gradients, bf16
   and fp16, with flash-attn's acceptance rule (error at most twice that of a plain low-precision
   PyTorch implementation, plus a small atol); and flex's block mask against
   ``create_block_mask(..., _compile=True)``;
   paths (issue 45), a PASS/FAIL row each: the anchor merge's path (a FAIL where CUDA runs the torch fallback),
   a deterministic backward on auto (two backward passes, bitwise-equal gradients), Megatron's plain
   PackedSeqParams through AnchorCoreAttention against the fp32 reference, and no host sync in an anchor
   forward on a prebuilt layout (``torch.cuda.set_sync_debug_mode("error")``); SKIP and why where CUDA is needed;
2. speed: forward and forward+backward of anchor attention per backend, and of anchor, intra_doc and
   full through the backend ``auto`` picks, against dense full-causal SDPA (flash) in the same run, on one
   packed window of 8K, 32K and 128K tokens (log-normal documents, 32 heads, 8 KV heads, head dim
   128, bf16): milliseconds, TFLOP/s over the kept (query, key) pairs, peak memory;
3. training: 20 steps of a small Llama-shaped model at 16K tokens in bf16 through the trainer's
   engine, attention_type anchor and full: tokens/s, peak memory, loss falling; then cp2;
4. cp2: a context-parallel run (torchrun, cp=2) when 2 or more GPUs are visible.
(Model-level tokens/s, MFU and HFU at users' shapes: ``scripts/bench_train.py``; both run in ``scripts/gpu_suite.sh``.)

Writes DIR/gpu_check.json and DIR/gpu_check.md, prints the table and one line per failure; the
exit status is 1 when something failed; a package the training sections need that does not import is a
failure. Without CUDA it says why and exits 0 (skipped). ``--quick`` shrinks every section (smaller
layouts, 8K/32K only, 5 steps at 4K). ``--cpu-smoke`` runs the chosen sections on the CPU at toy sizes
(one small layout, the lengths given, one step each): the plumbing, not the kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from nemo_anchor import gpu_check as check
from nemo_anchor.attention.layout import PackLayout, lognormal_documents
from nemo_anchor.atomic import atomic_file

BACKENDS = ("fa3", "te", "fa4", "torch_varlen", "flash", "flex", "reference")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fail(error: BaseException) -> str:
    return f"FAIL: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


# --- 1. conformance -----------------------------------------------------------------------------

def _inputs(case: check.Case, device):
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    q = torch.randn(case.q_len, case.heads, case.head_dim, generator=g)
    k, v = (torch.randn(case.total, case.kv_heads, case.head_dim, generator=g) for _ in range(2))
    grad = torch.randn(case.q_len, case.heads, case.head_dim, generator=g)
    return [x.to(device) for x in (q, k, v, grad)]


def _run(fn, inputs, grad, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(dtype))]


def conformance(quick: bool, device, smoke: bool = False) -> list[dict]:
    from nemo_anchor.attention import anchor_attention
    from nemo_anchor.attention.functional import unavailable_reason

    cases = check.conformance_cases(64 if smoke else 1024 if quick else 4096,
                                    head_shapes=check.HEAD_SHAPES[:1] if quick or smoke else check.HEAD_SHAPES)
    rows = []
    for case in cases:
        q, k, v, grad = _inputs(case, device)
        blocks = check.case_blocks(case)
        scale = case.head_dim ** -0.5
        bounds = dict(cu_seqlens=torch.tensor(case.doc_bounds, dtype=torch.int32, device=device),
                      cu_windows=torch.tensor(case.window_bounds, dtype=torch.int32, device=device),
                      mode=case.mode, q_offset=case.q_offset)
        reference = _run(lambda *x: anchor_attention(*x, backend="reference", **bounds), (q, k, v), grad, torch.float32)
        for dtype_name, dtype in DTYPES.items():
            baseline = _run(lambda *x: check.low_precision_attention(*x, blocks, case.q_offset, scale),
                            (q, k, v), grad, dtype)
            for backend in BACKENDS:
                row = {"backend": backend, "dtype": dtype_name, "mode": case.mode, "case": case.name}
                reason = unavailable_reason(backend, q.to(dtype), True, case.mode)
                if reason is not None:
                    rows.append({**row, "status": f"skipped: {reason}"})
                    continue
                try:
                    actual = _run(lambda *x: anchor_attention(*x, backend=backend, **bounds), (q, k, v), grad, dtype)
                    rows.append({**row, "tensors": [check.compare(name, a, b, r) for name, a, b, r in
                                                    zip(("out", "dq", "dk", "dv"), actual, baseline, reference)]})
                except Exception as error:  # noqa: BLE001 - reported, the check goes on
                    rows.append({**row, "status": _fail(error)})
        if not smoke:  # create_block_mask(_compile=True) compiles C++ on the CPU: minutes
            rows.extend(_flex_tiles(case, blocks, device))
    return _deduplicated_skips(rows)


def _flex_tiles(case: check.Case, blocks, device) -> list[dict]:
    """flex's derived block mask against create_block_mask(..., _compile=True) on this device (bf16 only)."""
    if case.heads != check.HEAD_SHAPES[0][0]:
        return []
    row = {"backend": "flex block mask", "dtype": "-", "mode": case.mode, "case": case.name}
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        from nemo_anchor.attention import flex

        ours = flex.block_mask(blocks, case.q_offset, case.total, device)
        theirs = create_block_mask(ours.mask_mod, None, None, case.q_len, case.total, device=device,
                                   BLOCK_SIZE=flex.TILE, _compile=True)
        same = all(torch.equal(_dense_tiles(*a), _dense_tiles(*b)) for a, b in (
            ((ours.kv_num_blocks, ours.kv_indices), (theirs.kv_num_blocks, theirs.kv_indices)),
            ((ours.full_kv_num_blocks, ours.full_kv_indices), (theirs.full_kv_num_blocks, theirs.full_kv_indices))))
        status = "ok: same tiles as create_block_mask(_compile=True)" if same else "FAIL: tiles differ from create_block_mask"
    except Exception as error:  # noqa: BLE001
        status = _fail(error)
    return [{**row, "status": status}]


def _dense_tiles(counts, indices) -> torch.Tensor:
    counts, indices = counts[0, 0].cpu(), indices[0, 0].cpu().long()
    out = torch.zeros(indices.shape[0], indices.shape[1] + 1, dtype=torch.bool)
    for row, n in enumerate(counts.tolist()):
        out[row, indices[row, :n]] = True
    return out[:, :-1]


def _deduplicated_skips(rows: list[dict]) -> list[dict]:
    """One row per skipped backend and reason instead of one per case and dtype."""
    seen, kept = set(), []
    for row in rows:
        if row.get("status", "").startswith("skipped"):
            key = (row["backend"], row["status"])
            if key in seen:
                continue
            seen.add(key)
            row = {**row, "dtype": "all", "mode": "all", "case": "all"}
        kept.append(row)
    return kept


# --- 1b. the anchor's paths (issue 45) ---------------------------------------------------------------

def paths(quick: bool, device, smoke: bool = False) -> list[dict]:
    """One PASS/FAIL row per path of issue 45 (SKIP and why where the check needs CUDA): which anchor merge runs
    (a FAIL where CUDA runs the torch fallback), a deterministic backward on ``auto`` (two backward passes give
    bitwise-equal gradients), Megatron's plain ``PackedSeqParams`` through ``AnchorCoreAttention`` against the fp32
    reference, and an anchor forward on a prebuilt layout without a host sync (its plan's pinned copies)."""
    tokens = 256 if smoke else 4096 if quick else 16384
    checks = {"anchor merge path": _merge_path_check, "deterministic backward (auto)": _deterministic_check,
              "Megatron's plain PackedSeqParams, anchor mask": _plain_params_check,
              "no host sync, anchor forward on a prebuilt layout": _no_sync_check}
    rows = []
    for name, run in checks.items():
        try:
            rows.append({"check": name, **run(tokens, device)})
        except Exception as error:  # noqa: BLE001 - reported, the other checks go on
            rows.append({"check": name, "status": "FAIL", "backend": "-", "detail": _fail(error)})
    return rows


def _path_inputs(tokens: int, device, dtype=torch.bfloat16, heads=(8, 2, 128)):
    """q, k, v (leaves), an output gradient and the documents of one packed window of ``tokens`` tokens."""
    h, hkv, d = heads
    g = torch.Generator(device="cpu").manual_seed(tokens)
    q = torch.randn(tokens, h, d, generator=g)
    k, v = (torch.randn(tokens, hkv, d, generator=g) for _ in range(2))
    grad = torch.randn(tokens, h, d, generator=g)
    docs = lognormal_documents(tokens, seed=1, mean_tokens=tokens / 8)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v)], grad.to(device, dtype), docs


def _merge_path_check(tokens: int, device) -> dict:
    from nemo_anchor.attention.anchor_key import merge_path
    from nemo_anchor.attention.functional import anchor_handling, choose_backend

    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device=device)  # what auto asks of the inputs: a training call
    backend = choose_backend("auto", q, True, "anchor").name
    path = merge_path(device)[1]
    handling = (anchor_handling(backend, "anchor", device)
                or f"{backend} merges no anchor; the merge on {device}: {path}")
    if device.type != "cuda":
        return {"status": "SKIP", "backend": backend,
                "detail": f"{handling}; whether the Triton merge runs is judged on CUDA only"}
    return {"status": "PASS" if path == "triton" else "FAIL", "backend": backend, "detail": handling}


def _deterministic_check(tokens: int, device) -> dict:
    from nemo_anchor.attention import anchor_attention
    from nemo_anchor.attention.functional import choose_backend

    (q, k, v), grad, docs = _path_inputs(tokens, device)
    layout = PackLayout.of(docs)
    backend = choose_backend("auto", q, True, "anchor", deterministic=True)
    runs = []
    for _ in range(2):
        out = anchor_attention(q, k, v, layout=layout, mode="anchor", backend=backend, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), grad))
    differ = [name for name, a, b in zip(("dq", "dk", "dv"), *runs) if not torch.equal(a, b)]
    detail = f"{tokens} tokens, bf16: " + (f"{', '.join(differ)} differ between two backward passes" if differ
                                           else "dq, dk, dv bitwise equal in two backward passes")
    return {"status": "FAIL" if differ else "PASS", "backend": backend.name, "detail": detail}


def _plain_params_check(tokens: int, device) -> dict:
    """AnchorCoreAttention on the THD params Megatron-LM's packed training builds (documents only: one window whose
    first token is the anchor), output and q/k/v gradients in bf16, by the conformance section's acceptance rule."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    from nemo_anchor.attention import anchor_attention
    from nemo_anchor.attention.functional import choose_backend
    from nemo_anchor.attention.layout import query_blocks
    from nemo_anchor.model.core_attention import AnchorCoreAttention

    tokens = min(tokens, 4096)  # the fp32 reference is dense
    (q, k, v), grad, docs = _path_inputs(tokens, device)
    heads, groups, head_dim = q.shape[1], k.shape[1], q.shape[2]
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0, hidden_dropout=0.0)
    core = AnchorCoreAttention(config, 1, AttnMaskType.causal, "self", mask="anchor", backend="auto",
                               pg_collection=ProcessGroupCollection(tp=None, cp=None))
    cu = torch.tensor(docs, dtype=torch.int32)
    lengths = cu[1:] - cu[:-1]
    _, params = get_thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, tokens, dtype=torch.long)}, cu.to(device),
                                              cu.to(device), lengths.max().reshape(1), cp_size=1, cp_rank=0)
    scale = head_dim ** -0.5
    blocks = query_blocks(docs, (0, tokens), "anchor", 0, tokens)  # the definition: one window, its first token
    inputs = [x.detach() for x in (q, k, v)]
    actual = _run(lambda *x: core(*x, None, packed_seq_params=params).view(tokens, heads, head_dim), inputs, grad,
                  torch.bfloat16)
    baseline = _run(lambda *x: check.low_precision_attention(*x, blocks, 0, scale), inputs, grad, torch.bfloat16)
    reference = _run(lambda *x: anchor_attention(*x, cu_seqlens=cu.to(device), mode="anchor", backend="reference"),
                     inputs, grad, torch.float32)
    tensors = [check.compare(name, a, b, r) for name, a, b, r in zip(("out", "dq", "dk", "dv"), actual, baseline,
                                                                        reference)]
    worst = max(tensors, key=lambda t: t["error"] / t["bound"])
    chosen = choose_backend("auto", q, True, "anchor").name  # what the core attention chose at its first forward
    return {"status": "PASS" if all(t["ok"] for t in tensors) else "FAIL", "backend": chosen,
            "detail": f"{tokens} tokens, {len(docs) - 1} documents, bf16 vs fp32 reference: worst {worst['tensor']} "
                      f"error {worst['error']:.3g} (bound {worst['bound']:.3g})"}


def _no_sync_check(tokens: int, device) -> dict:
    from nemo_anchor.attention import anchor_attention
    from nemo_anchor.attention.functional import choose_backend

    if device.type != "cuda":
        return {"status": "SKIP", "backend": "-",
                "detail": "torch.cuda.set_sync_debug_mode watches CUDA streams; the CPU has none"}
    (q, k, v), _, docs = _path_inputs(tokens, device)
    backend = choose_backend("auto", q, True, "anchor")
    anchor_attention(q, k, v, layout=PackLayout.of(docs), mode="anchor", backend=backend)  # kernels compiled
    layout = PackLayout.of(lognormal_documents(tokens, seed=2, mean_tokens=tokens / 8))  # its plan built below
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        anchor_attention(q, k, v, layout=layout, mode="anchor", backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"status": "PASS", "backend": backend.name,
            "detail": "a new layout's first forward: no host sync under torch.cuda.set_sync_debug_mode('error')"}


# --- 2. speed -----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    """Peak allocated GPU memory since the last reset; on the CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _time_ms(fn, warmup: int, repeats: int, device: torch.device) -> float:
    """The median of ``repeats`` calls after ``warmup``: CUDA events on a GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def speed(quick: bool, device, mean_doc: int, lengths: tuple[int, ...] | None = None,
          repeats: int | None = None) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nemo_anchor.attention import anchor_attention
    from nemo_anchor.attention.functional import select_backend, unavailable_reason

    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    warmup, repeats = (2, repeats or 3) if quick else (3, repeats or 10)
    rows = []
    for tokens in lengths or ((8192, 32768) if quick else (8192, 32768, 131072)):
        docs = lognormal_documents(tokens, seed=tokens, mean_tokens=mean_doc)
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(tokens, heads, head_dim, generator=g).to(device, dtype).requires_grad_()
        k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
        grad = torch.randn_like(q)
        cu = dict(cu_seqlens=torch.tensor(docs, dtype=torch.int32, device=device),
                  cu_windows=torch.tensor([0, tokens], dtype=torch.int32, device=device))

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1)

        methods = {"full-causal SDPA (flash)": ("full", "sdpa", sdpa)}
        for backend in BACKENDS[:-1]:  # the dense reference would need T^2 memory
            reason = unavailable_reason(backend, q, True, "anchor")
            methods[f"anchor_attention {backend}"] = ("anchor", backend, reason or (
                lambda b=backend: anchor_attention(q, k, v, mode="anchor", backend=b, **cu)))
        for mode in ("anchor", "intra_doc", "full"):  # each mask through what auto picks
            chosen = select_backend("auto", q, True, mode).__name__.rsplit(".", 1)[-1]
            methods[f"{mode} ({chosen}, auto)"] = (mode, chosen, lambda m=mode: anchor_attention(q, k, v, mode=m, **cu))
        sdpa_ms = None
        for method, (mode, backend, fn) in methods.items():
            row = {"tokens": tokens, "documents": len(docs) - 1, "method": method, "mode": mode, "backend": backend}
            if isinstance(fn, str):
                rows.append({**row, "status": f"skipped: {fn}"})
                continue
            pairs = PackLayout.of(docs).kept_pairs(mode)
            try:
                torch._dynamo.reset()  # a fresh compile budget for flex at this shape
                with torch.no_grad():
                    fwd = _time_ms(fn, warmup, repeats, device)
                train = _time_ms(lambda: fn().backward(grad), warmup, repeats, device)
                _sync(device)
                _reset_peak(device)
                fn().backward(grad)
                _sync(device)
                peak = _peak_gib(device)
                sdpa_ms = (fwd, train) if backend == "sdpa" else sdpa_ms
                rows.append({**row, "status": "ok", "kept_pairs": pairs, "fwd_ms": fwd, "fwd_bwd_ms": train,
                             "fwd_tflops": check.attention_tflops(pairs, heads, head_dim, fwd / 1e3, backward=False),
                             "fwd_bwd_tflops": check.attention_tflops(pairs, heads, head_dim, train / 1e3, backward=True),
                             "speedup_fwd": sdpa_ms[0] / fwd if sdpa_ms else "-",
                             "speedup_fwd_bwd": sdpa_ms[1] / train if sdpa_ms else "-", "peak_gib": peak})
            except Exception as error:  # noqa: BLE001
                rows.append({**row, "status": _fail(error)})
            finally:
                q.grad = k.grad = v.grad = None
        del q, k, v, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --- 3. training ----------------------------------------------------------------------------------

def _training_batch(tokens: int, vocab: int, mean_doc: int, seed: int) -> dict:
    """One packed window of learnable documents: BOS, then a walk along a fixed random permutation
    of the vocabulary (90% of steps) with random jumps, so the loss can fall within a few steps."""
    g = torch.Generator().manual_seed(seed)
    docs = lognormal_documents(tokens, seed, mean_tokens=mean_doc)
    successor = torch.randperm(vocab - 1, generator=g) + 1
    ids = torch.empty(tokens, dtype=torch.long)
    for start, end in zip(docs, docs[1:]):
        ids[start] = 0  # BOS
        current = int(torch.randint(1, vocab, (1,), generator=g))
        for i in range(start + 1, end):
            ids[i] = current
            jump = torch.rand(1, generator=g).item() < 0.1
            current = int(torch.randint(1, vocab, (1,), generator=g)) if jump else int(successor[current - 1])
    return dict(tokens=ids[None], labels=ids.roll(-1)[None], loss_mask=torch.ones(1, tokens),
                position_ids=torch.arange(tokens)[None], cu_seqlens=torch.tensor(docs, dtype=torch.int32),
                cu_windows=torch.tensor([0, tokens], dtype=torch.int32))


SMALL = dict(num_layers=4, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=2)
SMOKE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)


def _train(attention_type: str, tokens: int, steps: int, context_parallel: int, mean_doc: int,
           shape: dict = SMALL, vocab: int = 2048) -> dict:
    """``steps`` optimizer steps on one window through build_engine/train_step; this rank's numbers, with
    model TFLOP/s, MFU and HFU (nemo_anchor.model.flops, against the GPU's published bf16 peak)."""
    from nemo_anchor.model.flops import train_step_flops
    from nemo_anchor.training import throughput
    from nemo_anchor.attention.functional import select_backend
    from nemo_anchor.attention.paradigms import get_attention_type
    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.parallel.context_parallel import batch_for_this_rank
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.training.config import OptimConfig, RunConfig, TrainerConfig
    from nemo_anchor.training.engine import build_engine, train_step

    config = RunConfig(
        output_dir="unused",
        model=ModelConfig(attention_type=attention_type, seq_length=tokens, context_parallel_size=context_parallel,
                          **shape),
        trainer=TrainerConfig(precision="bf16", global_batch_size=1, micro_batch_size=1, max_steps=steps),
        optim=OptimConfig(lr=1e-3, warmup_steps=0)).validate()
    ctx = initialize_parallel(context_parallel_size=context_parallel)
    engine = build_engine(config, ctx, vocab)
    whole = _training_batch(tokens, vocab, mean_doc, seed=0)
    flops = train_step_flops(config.model, vocab, [whole["cu_seqlens"]])
    batch = batch_for_this_rank(whole, attention_type, ctx.device)
    probe = torch.zeros(1, 8, 64, dtype=torch.bfloat16, device=ctx.device)
    mode = get_attention_type(attention_type).mask
    backend = select_backend(config.model.attention_backend, probe, True, mode).__name__.rsplit(".", 1)[-1]
    _reset_peak(ctx.device)
    losses, times = [], []
    for _ in range(steps):
        _sync(ctx.device)
        start = time.perf_counter()
        losses.append(train_step(engine, config, [batch])["loss"])
        _sync(ctx.device)
        times.append(time.perf_counter() - start)
    step_s = sorted(times[2:] or times)[len(times[2:] or times) // 2]  # the median after two warm-up steps
    head, tail = losses[:3], losses[-3:]
    peak, peak_source = throughput.resolve_peak_tflops(None, ctx.device, "bf16")
    rates = throughput.rates(flops, step_s, context_parallel, peak)
    result = {"status": "ok", "backend": backend, "steps": steps, "tokens": tokens, "step_s": step_s,
              "tokens_per_s": tokens / step_s, "tflops_per_gpu": rates["tflops_per_device"], "mfu": rates["mfu"],
              "hfu": rates["hfu"], "peak_tflops": f"{peak:g} ({peak_source})",
              "peak_gib": _peak_gib(ctx.device),
              "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
              "loss_falling": sum(tail) / len(tail) < sum(head) / len(head)}
    if not result["loss_falling"]:
        result["status"] = "FAIL: the loss did not fall"
    del engine
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _engine_missing(section: str) -> list[dict] | None:
    """A FAIL row naming the first package the trainer's engine needs that does not import, or None."""
    for module in ("megatron.core", "omegaconf"):  # the engine's and the run config's
        try:
            __import__(module)
        except Exception as error:  # noqa: BLE001
            return [{"run": section, "status": f"FAIL: {module} does not import ({type(error).__name__}: "
                     f"{error}); bring its wheels (../shared/gpu/README.md)"}]
    return None


def _training_size(quick: bool, smoke: bool) -> tuple[int, int, dict, int]:
    """(tokens, steps, shape, vocabulary) of the training sections."""
    if smoke:
        return 128, 6, SMOKE, 256
    return (4096, 5, SMALL, 2048) if quick else (16384, 20, SMALL, 2048)


def training(quick: bool, mean_doc: int, smoke: bool = False) -> list[dict]:
    tokens, steps, shape, vocab = _training_size(quick, smoke)
    missing = _engine_missing("training")
    if missing:
        return missing
    rows = []
    for attention_type in ("anchor", "full"):
        run = f"{attention_type}, {tokens} tokens, 1 {'process' if smoke else 'GPU'}"
        try:
            rows.append({"run": run, **_train(attention_type, tokens, steps, 1, mean_doc, shape, vocab)})
        except Exception as error:  # noqa: BLE001
            rows.append({"run": run, "status": _fail(error)})
    return rows + cp2(quick, mean_doc, smoke)


def cp2(quick: bool, mean_doc: int, smoke: bool = False) -> list[dict]:
    """One anchor run over two GPUs with context parallelism 2 (torchrun), when two are visible (``smoke``: two
    CPU processes)."""
    tokens, steps, _, _ = _training_size(quick, smoke)
    missing = _engine_missing("cp2")
    if missing:
        return missing
    rows = []
    gpus = torch.cuda.device_count()
    run = f"anchor, {tokens} tokens, context parallel 2"
    if gpus < 2 and not smoke:
        rows.append({"run": run, "status": f"skipped: {gpus} GPU visible, context parallelism needs 2"})
        return rows
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--cp-worker", "--mean-doc", str(mean_doc), *(["--quick"] if quick else []),
               *(["--cpu-smoke"] if smoke else [])]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        rows.append({"run": run, "status": f"FAIL: torchrun exit {done.returncode}: {tail}"[:300]})
    else:
        rows.append({"run": run, **json.loads(lines[-1])})
    return rows


def cp_worker(args) -> None:
    import torch.distributed as dist

    tokens, steps, shape, vocab = _training_size(args.quick, args.cpu_smoke)
    result = _train("anchor", tokens, steps, 2, args.mean_doc, shape, vocab)
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


# --- the report ---------------------------------------------------------------------------------

def write_report(results: dict, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    with atomic_file(output / "gpu_check.json") as tmp:
        tmp.write_text(json.dumps(results, indent=1, default=str))
    with atomic_file(output / "gpu_check.md") as tmp:
        tmp.write_text(check.markdown_report(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller layouts, 8K/32K, 5 training steps at 4K")
    parser.add_argument("--output", type=Path, default=Path("gpu_check_out"), help="where the JSON and markdown go")
    parser.add_argument("--sections", nargs="+", choices=("conformance", "paths", "speed", "training", "cp2"),
                        default=["conformance", "paths", "speed", "training"])
    parser.add_argument("--lengths", type=int, nargs="+", help="speed: window lengths (default 8K 32K 128K)")
    parser.add_argument("--repeats", type=int, help="speed: timed calls per method (default 3 with --quick, else 10)")
    parser.add_argument("--mean-doc", type=int, default=4096, help="mean document length (log-normal)")
    parser.add_argument("--cpu-smoke", action="store_true", help="on the CPU at toy sizes: the plumbing only")
    parser.add_argument("--cp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cp_worker:
        cp_worker(args)
        return 0
    reason = None if args.cpu_smoke else check.cuda_unavailable_reason()
    if reason is not None:
        results = {"skipped": reason}
        write_report(results, args.output)
        print(f"gpu_check: skipped: {reason}")
        return 0
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", torch.cuda.current_device())
    results = {"environment": check.environment(), "quick": args.quick, "cpu_smoke": args.cpu_smoke}
    smoke = args.cpu_smoke
    sections = {"conformance": lambda: conformance(args.quick, device, smoke),
                "paths": lambda: paths(args.quick, device, smoke),
                "speed": lambda: speed(args.quick or smoke, device, args.mean_doc, args.lengths, args.repeats),
                "training": lambda: training(args.quick, args.mean_doc, smoke),
                "cp2": lambda: cp2(args.quick, args.mean_doc, smoke)}
    for name in args.sections:
        started = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as error:  # noqa: BLE001 - one broken section must not hide the others
            results[name] = [{"backend": name, "run": name, "tokens": "-", "method": name, "status": _fail(error)}]
        print(f"gpu_check: {name} done in {time.perf_counter() - started:.0f} s", flush=True)
        write_report(results, args.output)  # what is done survives a later crash
    print(check.markdown_report(results))
    failures = check.failure_lines(results)
    for line in failures:
        print(f"gpu_check FAILED: {line}")
    print(f"gpu_check: {len(failures)} failure(s); results in {args.output}/gpu_check.json and gpu_check.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
