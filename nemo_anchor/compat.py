"""The one place that knows which transformers release is installed (4.57 with NeMo 2.7, 5.x with
Megatron-Bridge 0.6). Everything else imports these names instead of asking for a version.

- ``bytes_to_unicode``: transformers 5 moved it from ``models.gpt2.tokenization_gpt2`` to
  ``convert_slow_tokenizer``.
- ``no_init_weights``: transformers 5 moved it from ``modeling_utils`` to ``initialization``.
- RoPE fields of a config: 4.x keeps ``rope_theta`` and a ``rope_scaling`` dict; 5.x keeps one
  ``rope_parameters`` dict holding ``rope_type``, ``rope_theta`` and the scaling keys.
"""
from __future__ import annotations

try:  # transformers >= 5
    from transformers.convert_slow_tokenizer import bytes_to_unicode
except ImportError:  # transformers 4.x
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

try:  # transformers >= 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4.x
    from transformers.modeling_utils import no_init_weights

__all__ = ["bytes_to_unicode", "no_init_weights", "hf_rope", "hf_rope_fields"]


def hf_rope(hf_config) -> tuple[float, dict]:
    """(``rope_theta``, the scaling dict without it: ``rope_type`` or legacy ``type`` plus its keys) of an HF config."""
    parameters = getattr(hf_config, "rope_parameters", None)
    if parameters:  # transformers 5: theta and scaling in one dict
        scaling = dict(parameters)
        theta = scaling.pop("rope_theta")
        if scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = {key: value for key, value in scaling.items() if key not in ("rope_type", "type")}
        return float(theta), scaling
    return float(hf_config.rope_theta), dict(getattr(hf_config, "rope_scaling", None) or {})


def hf_rope_fields(theta: float, scaling: dict | None) -> dict:
    """The keyword arguments that give a transformers config of this release ``theta`` and ``scaling``."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": float(theta)}}
    return {"rope_theta": float(theta), "rope_scaling": scaling}
