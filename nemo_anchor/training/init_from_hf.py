"""``model.init_from_hf``: a fresh run's starting weights, from an HF directory or any checkpoint we read.

The formats are read by :mod:`nemo_anchor.convert` (the same readers ``export-hf`` uses); our own
checkpoints through :func:`nemo_anchor.training.checkpoint.load_weights`, this rank's shards only.
"""
from __future__ import annotations

import os

import torch

from nemo_anchor.convert.hf_mapping import check_hf_dir
from nemo_anchor.convert.hf_slices import has_safetensors, sliced_state
from nemo_anchor.convert.megatron_state import check_state, load_into_model
from nemo_anchor.convert.sources import HF, NEMO_ANCHOR, checkpoint_kind, read_checkpoint, read_model_config
from nemo_anchor.convert.weight_match import config_key_explainer, match_weights
from nemo_anchor.training.checkpoint import load_weights

# Megatron TransformerConfig fields that fix every weight's shape: a mismatch is named before loading.
_STRUCTURE = (("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("ffn_hidden_size", "ffn_hidden_size"),
              ("num_attention_heads", "num_attention_heads"), ("num_query_groups", "num_query_groups"),
              ("kv_channels", "kv_channels"), ("add_qkv_bias", "qkv_bias"))


def init_model_from_hf(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Copy the weights of ``path`` into the Megatron ``model`` (``model.init_from_hf``): this rank's
    tensor- and pipeline-parallel shard, read alone where the format allows.

    ``path`` is a local HF directory (safetensors are read slice by slice), a nemo-anchor checkpoint
    or ``import-hf`` output (``dist_checkpointing`` reads this rank's shards, full precision), or any
    other checkpoint :func:`read_checkpoint` accepts (read whole). The layer structure must match;
    RoPE base and window may differ, which is the point of continued long-context training.
    """
    kind = checkpoint_kind(path)
    if kind == HF and has_safetensors(path):
        config, source = read_model_config(path)
        _check_structure(model, config, source, head="lm_head.weight")
        # every tensor of the files used, every one the config describes present: from the headers alone
        check_hf_dir(path, config)
        with sliced_state(path, config) as state:
            check_state(state, config, state["embedding.word_embeddings.weight"].shape[0], source=str(path))
            load_into_model(model, state, source=str(path))
    elif kind == NEMO_ANCHOR:
        config, source = read_model_config(path)
        _check_structure(model, config, source)
        load_weights(model, source)
    else:
        ckpt = read_checkpoint(path)
        _check_structure(model, ckpt.config, ckpt.path, head="lm_head.weight" if ckpt.kind == HF else None)
        load_into_model(model, ckpt.state, source=str(ckpt.path))


def _check_structure(model: torch.nn.Module, config, source, head: str | None = None) -> None:
    """ValueError naming the key when ``config`` (the source's) gives weights of other shapes than the
    model being trained, or an output layer it would drop or lacks (``head``: the source's name for it)."""
    for ours, theirs in _STRUCTURE:
        have, want = getattr(model.config, ours), getattr(config, theirs)
        if have != want:
            raise ValueError(f"{source}: {theirs}={want} but the model being trained has {ours}={have}")
    if not getattr(model, "post_process", True):
        return  # a pipeline stage without the output layer
    head = head or "output_layer.weight"
    tied = model.share_embeddings_and_output_weights
    shape = (getattr(model, "true_vocab_size", model.vocab_size), model.config.hidden_size)
    match_weights({} if config.tie_embeddings else {head: shape}, {} if tied else {head: shape}, source=str(source),
                  explain=config_key_explainer("the model being trained", {}, {}, is_layer=lambda name: False,
                                               layers="", head=head, tied=f"model.tie_embeddings={tied}",
                                               fallback=""))
