"""Ablation variants: an attention type, optionally with the paper's packing options.

``NAME = ATTENTION_TYPE[+tag|+interleave]``: ``anchor+tag`` is AnchorAttention trained on windows
whose documents carry a loss-masked domain tag ("+ Tag", Table 4); ``anchor+interleave`` on windows
of interleaved document chunks (Section 3.3). Plain names use the plain packing.
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_anchor.attention.paradigms import attention_type_names

PACKINGS = {"": "plain", "tag": "tag", "interleave": "interleave"}
MAIN_VARIANTS = ("full", "intra_doc", "intra_doc_reset", "anchor")


@dataclass(frozen=True)
class Variant:
    name: str
    attention_type: str  # a registered attention type (nemo_anchor.attention.paradigms)
    packing: str  # plain | tag | interleave: which packed dataset it trains on


def parse_variant(name: str) -> Variant:
    """``"anchor+tag"`` -> ``Variant("anchor+tag", "anchor", "tag")``; ValueError naming the bad part."""
    attention, _, option = name.strip().partition("+")
    if attention not in attention_type_names():
        raise ValueError(f"--variants: unknown attention type {attention!r} in {name!r}; "
                         f"choose one of {attention_type_names()}")
    if option not in PACKINGS:
        raise ValueError(f"--variants: unknown packing option {option!r} in {name!r}; "
                         f"choose one of {[key for key in PACKINGS if key]} (e.g. anchor+tag)")
    return Variant(name.strip(), attention, PACKINGS[option])


def parse_variants(spec: str) -> list[Variant]:
    """A comma-separated list of distinct variant names, e.g. ``"full,intra_doc,anchor,anchor+tag"``."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--variants: no variant given in {spec!r}; e.g. {','.join(MAIN_VARIANTS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--variants: {repeated} listed more than once")
    return [parse_variant(name) for name in names]
