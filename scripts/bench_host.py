"""Host work per attention layer: Python function calls per layer forward and backward (cProfile), on the CPU.

A CPU proxy for what a GPU step pays on the host in every layer: Megatron's core attention
(:class:`~nemo_anchor.model.core_attention.AnchorCoreAttention`, as every front door builds it) runs ``--layers``
layers of one packed micro-batch through the flash-attn stand-ins (tests/varlen_standins.py, computing through
torch's CPU flash kernel), after one warm-up layer that builds what the micro-batch shares. Counted: every
Python function call (cProfile), divided by the layers; the kernels' own work is C++ and not counted. The
count is machine-independent; it is what choosing the backend and finding the plans cost per layer.

    python scripts/bench_host.py [--tokens 32768] [--mean-document 256] [--layers 8]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from bench_args import attention_path, positive_float, positive_int  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=32768)
    parser.add_argument("--mean-document", type=positive_float, default=256)
    parser.add_argument("--layers", type=positive_int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import varlen_standins
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_anchor import gpu
    from nemo_anchor.attention import flash
    from nemo_anchor.attention.layout import lognormal_documents
    from nemo_anchor.model.core_attention import AnchorCoreAttention
    from nemo_anchor.model.packed_seq import make_packed_seq_params

    gpu.flash_attn_varlen_func = lambda: (varlen_standins.with_autograd(varlen_standins.flash_attn_varlen_func), None)
    gpu.flash_attn_varlen_backward = lambda: (varlen_standins.flash_attn_varlen_backward, None)
    flash.unavailable_reason = lambda q, needs_grad: None
    heads, kv_heads, head_dim = 2, 1, 16
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=kv_heads, attention_dropout=0.0)
    module = AnchorCoreAttention(config, 1, AttnMaskType.causal, "self", mask="anchor", backend="flash",
                                 pg_collection=types.SimpleNamespace(cp=None))
    docs = torch.tensor(lognormal_documents(args.tokens, 0, args.mean_document), dtype=torch.int32)
    params = make_packed_seq_params(docs, torch.tensor([0, args.tokens], dtype=torch.int32), "anchor")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(args.tokens, heads, head_dim, generator=g, requires_grad=True)
    k, v = (torch.randn(args.tokens, kv_heads, head_dim, generator=g, requires_grad=True) for _ in range(2))

    def calls(function) -> int:
        profile = cProfile.Profile()
        profile.enable()
        function()
        profile.disable()
        return pstats.Stats(profile).total_calls

    with varlen_standins.cpu_flash_math():
        module(q, k, v, None, packed_seq_params=params).sum().backward()  # the micro-batch's first layer
        outs = []
        forward = calls(lambda: outs.extend(module(q, k, v, None, packed_seq_params=params)
                                            for _ in range(args.layers)))
        backward = calls(lambda: torch.stack(outs).sum().backward())
    print(f"attention: {attention_path('flash', 'anchor', torch.device('cpu'))} (stand-in kernels, CPU)")
    print(f"{args.tokens} tokens, {len(docs) - 1} documents, {args.layers} layers after a warm-up layer")
    print("| per layer | Python calls (the stand-ins' own included) |")
    print("| --- | --- |")
    for phase, count in (("forward", forward), ("backward", backward)):
        print(f"| {phase} | {count / args.layers:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
