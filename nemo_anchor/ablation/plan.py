"""Where an ablation keeps things, and the training config of each variant.

::

    DIR/plan.yaml                       the training-relevant config of the first run (re-runs must match)
    DIR/data/plain|tag|interleave/      the packed documents (plain/valid: every variant's held-out data)
    DIR/variants/NAME/run.yaml          the variant's RunConfig (``nemo-anchor train --config`` reads it)
    DIR/variants/NAME/train/            its training output_dir (nemo_anchor.run_dir layout)
    DIR/variants/NAME/start.json        digest of the weights it started from
    DIR/variants/NAME/eval.json         its measurements over the last K checkpoints
    DIR/ablation.json, ablation.md, *.png
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from nemo_anchor.ablation.config import AblationConfig
from nemo_anchor.ablation.variants import Variant
from nemo_anchor.data.layout import VALID_SUBDIR
from nemo_anchor.atomic import atomic_file
from nemo_anchor.training.config import DataConfig, RunConfig

# what every variant must share; eval settings may change between runs (variants are re-evaluated)
SHARED_SECTIONS = ("model", "trainer", "optim", "checkpoint", "pack")


@dataclass(frozen=True)
class AblationPlan:
    config: AblationConfig
    variants: tuple[Variant, ...]
    root: Path

    @property
    def packings(self) -> list[str]:
        """Packings to build, ``plain`` first: it holds the held-out split and fixes the tokenizer."""
        return ["plain", *sorted({v.packing for v in self.variants} - {"plain"})]

    def data_dir(self, packing: str) -> Path:
        return self.root / "data" / packing

    @property
    def valid_dir(self) -> Path:
        return self.data_dir("plain") / VALID_SUBDIR

    def variant_dir(self, variant: Variant) -> Path:
        return self.root / "variants" / variant.name

    def output_dir(self, variant: Variant) -> Path:
        return self.variant_dir(variant) / "train"

    def run_config_file(self, variant: Variant) -> Path:
        return self.variant_dir(variant) / "run.yaml"

    def start_file(self, variant: Variant) -> Path:
        return self.variant_dir(variant) / "start.json"

    def eval_file(self, variant: Variant) -> Path:
        return self.variant_dir(variant) / "eval.json"

    def run_config(self, variant: Variant) -> RunConfig:
        """The variant's training config: the shared sections with its attention type and packed data."""
        c = self.config
        return RunConfig(
            output_dir=str(self.output_dir(variant)),
            model=replace(c.model, attention_type=variant.attention_type),
            data=DataConfig(path=str(self.data_dir(variant.packing)), valid_path=str(self.valid_dir)),
            trainer=copy.deepcopy(c.trainer), optim=copy.deepcopy(c.optim), checkpoint=copy.deepcopy(c.checkpoint),
        ).validate()

    def check_variants(self) -> None:
        """Every variant's RunConfig validates (ValueError names the variant and the key)."""
        for variant in self.variants:
            try:
                self.run_config(variant)
            except ValueError as err:
                raise ValueError(f"variant {variant.name}: {err}") from None

    def shared_settings(self) -> dict:
        """The sections every variant shares (SHARED_SECTIONS), as plain data."""
        tree = OmegaConf.to_container(OmegaConf.structured(self.config))
        return {key: tree[key] for key in SHARED_SECTIONS}

    @property
    def plan_file(self) -> Path:
        return self.root / "plan.yaml"

    def compare_with_recorded(self) -> None:
        """ValueError listing every shared key that changed since the ablation's first training started."""
        if not self.plan_file.is_file():
            return
        before = _flatten(OmegaConf.to_container(OmegaConf.load(self.plan_file)))
        now = _flatten(self.shared_settings())
        changed = sorted(key for key in before.keys() | now.keys() if before.get(key) != now.get(key))
        if changed:
            details = ", ".join(f"{key}: {before.get(key)!r} -> {now.get(key)!r}" for key in changed)
            raise ValueError(f"{self.root} holds an ablation trained with other settings ({details}); finished "
                             f"variants would not be comparable: use a new --output or the same config")

    def record(self) -> None:
        """Write ``DIR/plan.yaml`` (once every check passed, before the first training step)."""
        if not self.plan_file.is_file():
            with atomic_file(self.plan_file) as tmp:
                tmp.write_text(OmegaConf.to_yaml(self.shared_settings()))


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
