"""Hugging Face export and import.

- :func:`export_hf`: a nemo-anchor training checkpoint or a NeMo 2 checkpoint -> a
  ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` directory (config.json,
  safetensors, tokenizer files, generation_config.json) that transformers loads offline with no
  custom code: at inference a document starts with BOS at position 0, where AnchorAttention is
  plain causal attention.
- :func:`import_hf`: a local HF Llama/Mistral/Qwen2 directory -> a starting checkpoint in the
  training layout (``config.yaml``, ``tokenizer/``, ``checkpoints/iter_0000000``).

Outputs are staged in a temporary directory and renamed when complete.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import torch

from nemo_anchor.atomic import atomic_directory
from nemo_anchor.convert.hf_mapping import HF_CLASSES, megatron_to_hf_state, to_hf_config
from nemo_anchor.convert.megatron_state import build_model, load_into_model
from nemo_anchor.convert.sources import LoadedCheckpoint, read_checkpoint
from nemo_anchor.hf_dir import require_hf_dir


def load_tokenizer(ckpt: LoadedCheckpoint):
    """The checkpoint's HF tokenizer, or None (with a warning) when it has none."""
    if ckpt.tokenizer_dir is None:
        warnings.warn(f"{ckpt.path}: no tokenizer files found; the output will have no tokenizer", stacklevel=2)
        return None
    from transformers import AutoTokenizer

    # Llama/Mistral/Qwen2 take no token_type_ids; a tokenizer that emits them breaks `generate(**inputs)`
    return AutoTokenizer.from_pretrained(ckpt.tokenizer_dir, model_input_names=["input_ids", "attention_mask"])


def to_hf_model(ckpt: LoadedCheckpoint, dtype: torch.dtype = torch.float32):
    """``(transformers model, tokenizer or None)`` holding the checkpoint's weights, in ``dtype``, eval mode."""
    import transformers

    from nemo_anchor.compat import no_init_weights

    tokenizer = load_tokenizer(ckpt)
    special = {} if tokenizer is None else dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    hf_config = to_hf_config(ckpt.config, ckpt.vocab_size, dtype=dtype, **special)
    model_class = getattr(transformers, HF_CLASSES[ckpt.config.architecture][1])
    with no_init_weights():  # every weight is assigned below; skip the random init
        model = model_class(hf_config)
    state = {k: v.to(dtype) for k, v in megatron_to_hf_state(ckpt.state, ckpt.config).items()}
    if ckpt.config.tie_embeddings:  # one tensor for both again (the cast above may have copied each)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval(), tokenizer


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              overwrite: bool = False) -> Path:
    """Write the HF directory of ``checkpoint`` (training output_dir, iter dir or NeMo 2 dir) to ``out_dir``."""
    with atomic_directory(out_dir, inputs=[checkpoint], overwrite=overwrite, command="export-hf") as staging:
        model, tokenizer = to_hf_model(read_checkpoint(checkpoint), dtype)
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return Path(out_dir)


def import_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a starting checkpoint (training layout, step 0) for the HF model in ``hf_dir``.

    ``config.yaml`` holds the ``model:`` section read from the HF config (window =
    ``max_position_embeddings``, base = ``rope_theta``): edit ``seq_length`` and ``rotary_base``
    for long-context training.
    """
    from megatron.core import dist_checkpointing
    from omegaconf import OmegaConf

    from nemo_anchor.run_dir import RunDir
    from nemo_anchor.training.checkpoint import record_checksums

    require_hf_dir(hf_dir)
    with atomic_directory(out_dir, inputs=[hf_dir], overwrite=overwrite, command="import-hf") as staging:
        ckpt = read_checkpoint(hf_dir)
        model = build_model(ckpt.config, ckpt.vocab_size)
        load_into_model(model, ckpt.state, source=str(ckpt.path))
        run_config = OmegaConf.to_yaml({"model": dataclasses.asdict(ckpt.config)})
        run = RunDir(staging)
        run.config.write_text(run_config)
        iteration = run.checkpoint(0)
        iteration.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(prefix="model.")}, str(iteration))
        (iteration / "config.yaml").write_text(run_config)
        record_checksums(iteration)  # read back as every checkpoint is: verified
        run.latest_file.write_text("0")
        tokenizer = load_tokenizer(ckpt)
        if tokenizer is not None:
            tokenizer.save_pretrained(run.tokenizer)
    return Path(out_dir)
