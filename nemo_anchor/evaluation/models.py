"""Resolve a model path to a Hugging Face causal LM and its tokenizer, offline.

Two kinds of paths are accepted:
- a Hugging Face directory (it holds ``config.json``): loaded with ``AutoModelForCausalLM`` and
  ``AutoTokenizer`` from local files only. Its weights must be exactly those its config describes:
  a tensor missing, unused or of another shape is refused (naming it, both shapes and the config
  key) instead of being initialised at random or dropped;
- anything else (a training ``output_dir`` or one of its checkpoint directories): handed to
  ``nemo_anchor.export.inference.load_hf_model``, which converts our checkpoints to the same kind
  of model. It is imported only then, so HF directories need nothing from the export package.
"""
from __future__ import annotations

from pathlib import Path

import torch

from nemo_anchor.hf_dir import is_hf_dir, load_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16" | "fp16" | "fp32"`` -> torch dtype (ValueError names the bad value)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def load_model(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
    """Load ``(model, tokenizer)`` for inference: the model in eval mode, on ``device``, in ``dtype``.

    The dtype is applied at load time, never with ``model.to(dtype)``: that would also round
    the fp32 RoPE ``inv_freq`` buffer, which a model loaded in bf16 keeps in fp32.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    if is_hf_dir(path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _check_hf_weights(path)
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                                  output_loading_info=True)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - what transformers and safetensors raise varies by file
            raise load_error(path, error) from None
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if loading.get(kind):  # an architecture the check above does not map: transformers' own account
                names = sorted(map(str, loading[kind]))
                raise ValueError(f"{path}: the weights do not match {path / 'config.json'}: {kind.replace('_', ' ')} "
                                 f"{names[:4]} ({len(names)} in all)")
    else:
        from nemo_anchor.export.inference import load_hf_model

        model, tokenizer = load_hf_model(path, dtype=dtype)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found for the model at {path}")
    return model.to(device).eval(), tokenizer


def _check_hf_weights(path: Path) -> None:
    """For the families import-hf reads (Llama, Mistral, Qwen2), compare the weights' tensor names and shapes
    (safetensors headers) with the config before transformers builds anything."""
    from transformers import AutoConfig

    from nemo_anchor.convert.hf_mapping import check_hf_dir, model_config_from_hf

    try:
        config = model_config_from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - another family or an unreadable config: from_pretrained names it
        return
    check_hf_dir(path, config)
