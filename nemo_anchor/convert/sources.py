"""Read a model from any directory a user may point at, into one form.

Accepted, told apart by their files:

- a Hugging Face directory (``config.json``): a Llama, Mistral or Qwen2 checkpoint;
- a NeMo 2 checkpoint (``weights/`` written by ``dist_checkpointing``, ``context/model.yaml``
  for the config, ``context/nemo_tokenizer/`` for HF tokenizer files when NeMo used one);
- a nemo-anchor training ``output_dir`` (its newest intact checkpoint) or one ``iter_NNNNNNN``
  checkpoint directory (``nemo_anchor.run_dir`` layout), its files verified against their checksums
  first (:func:`nemo_anchor.checksums.verified_checkpoint`).

Dist checkpoints are read tensor by tensor from their metadata, without building a model,
so NeMo's Transformer-Engine parameter names need no TE here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_anchor.convert.hf_mapping import check_hf_weights, hf_to_megatron_state, model_config_from_hf
from nemo_anchor.convert.megatron_config import model_config_from_megatron
from nemo_anchor.convert.megatron_state import MASTER_PREFIX, canonical_state, check_state
from nemo_anchor.hf_dir import CONFIG_FILE, is_hf_dir, read_hf_tensors
from nemo_anchor.model.config import ModelConfig

HF = "huggingface"
NEMO2 = "nemo2"
NEMO_ANCHOR = "nemo-anchor"

# NeMo 2 config class name (its ``_target_``) -> our architecture; checked in order
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class LoadedCheckpoint:
    """A model as read from disk: its config and weights in canonical Megatron form."""

    path: Path  # the directory the weights came from
    kind: str  # HF | NEMO2 | NEMO_ANCHOR
    config: ModelConfig
    vocab_size: int  # rows of the embedding (NeMo pads the tokenizer's vocabulary)
    state: dict[str, torch.Tensor]  # see nemo_anchor.convert.megatron_state
    tokenizer_dir: Optional[Path]  # HF tokenizer files, when the checkpoint has them


def checkpoint_kind(path: str | os.PathLike) -> str:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if is_hf_dir(path):
        return HF
    if (path / "weights").is_dir() and (path / "context").is_dir():
        return NEMO2
    return NEMO_ANCHOR


def read_checkpoint(path: str | os.PathLike) -> LoadedCheckpoint:
    """Config, weights and tokenizer location of a checkpoint of any accepted kind (module docstring).

    Raises FileNotFoundError for a missing path or file, ValueError for unreadable, corrupt or
    unsupported content (the message names the file and the key).
    """
    kind = checkpoint_kind(path)
    reader = {HF: _read_huggingface, NEMO2: _read_nemo2, NEMO_ANCHOR: _read_nemo_anchor}[kind]
    return reader(Path(path))


def read_model_config(path: str | os.PathLike) -> tuple[ModelConfig, Path]:
    """The ``model:`` config of an HF directory or a nemo-anchor checkpoint, without reading weights;
    returns it with the directory the weights are in (a run's checkpoint: its newest intact iteration,
    verified)."""
    path = Path(path)
    if checkpoint_kind(path) == HF:
        return _huggingface_config(path), path
    from nemo_anchor.checksums import verified_checkpoint

    ckpt_dir = verified_checkpoint(path)
    return _nemo_anchor_config(ckpt_dir), ckpt_dir


def _huggingface_config(path: Path) -> ModelConfig:
    import transformers

    source = path / CONFIG_FILE
    try:  # transformers raises what the config's own class raises: AttributeError, TypeError, KeyError...
        hf_config = transformers.AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{source}: not a readable transformers config ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None
    try:
        config = model_config_from_hf(hf_config, source=str(source))
    except (AttributeError, TypeError, KeyError) as err:  # a field of another family, absent or of another type
        raise ValueError(f"{source}: not a supported config ({type(err).__name__}: {err})") from None
    return config


def _read_huggingface(path: Path) -> LoadedCheckpoint:
    config = _huggingface_config(path)
    tensors = read_hf_tensors(path)
    check_hf_weights({name: tuple(t.shape) for name, t in tensors.items()}, config, config.vocab_size,
                     source=str(path), config_source=str(path / CONFIG_FILE), read=lambda names: tensors)
    tensors = {name: t.to(torch.float32) for name, t in tensors.items()}
    state = hf_to_megatron_state(tensors, config, source=str(path))
    return _checked(path, HF, config, state, find_tokenizer_dir(path))


def _read_nemo2(path: Path) -> LoadedCheckpoint:
    model_yaml = path / "context" / "model.yaml"
    if not model_yaml.is_file():
        raise FileNotFoundError(f"NeMo 2 checkpoint without its config: {model_yaml}")
    try:
        nemo = yaml.safe_load(model_yaml.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{model_yaml}: corrupt YAML: {err}") from None
    if not isinstance(nemo.get("config"), dict):
        raise ValueError(f"{model_yaml}: no 'config' section")
    config = model_config_from_megatron(nemo["config"], source=str(model_yaml))
    tensors = read_dist_checkpoint(path / "weights", prefix="module.")
    state = canonical_state(tensors, config.num_layers, source=str(path / "weights"))
    tokenizer_dir = _nemo2_tokenizer_dir(path / "context", nemo.get("tokenizer"))
    vocab_size = config.vocab_size
    if vocab_size is None and tokenizer_dir is not None:  # NeMo padded the tokenizer's len() (base.py:380)
        from nemo_anchor.data.tokenizer import load_tokenizer

        vocab_size = load_tokenizer(tokenizer_dir).vocab_size
    state = _without_vocab_padding(state, vocab_size, source=str(path / "weights"))
    return _checked(path, NEMO2, config, state, tokenizer_dir)


_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _without_vocab_padding(state: dict, vocab_size: Optional[int], *, source: str) -> dict:
    """The state with the rows NeMo pads the vocabulary with (to ``make_vocab_size_divisible_by`` x tensor
    parallel) dropped, so the model has ``vocab_size`` rows (the config's, else its tokenizer's), as NeMo's
    own HF exporters give it (``TransformFns.prune_padding``). ValueError when a tensor has fewer rows."""
    if vocab_size is None:  # neither the config nor a tokenizer says: the rows are the vocabulary
        return state
    for key in _VOCAB_ROWS:
        rows = state[key].shape[0] if key in state else vocab_size
        if rows < vocab_size:
            raise ValueError(f"{source}: {key} has {rows} rows, fewer than the config's vocab_size={vocab_size}")
    return {key: t[:vocab_size] if key in _VOCAB_ROWS else t for key, t in state.items()}


def check_nemo2_weights(checkpoint: Path, config: Optional[ModelConfig] = None) -> ModelConfig:
    """ValueError unless the weights of NeMo 2 checkpoint ``checkpoint`` are the tensors ``config`` (default: its
    ``context/model.yaml``) describes, compared from the ``dist_checkpointing`` metadata alone, before NeMo
    loads them (NeMo's own error on a mismatch suggests loading less strictly); returns the config."""
    from megatron.core import dist_checkpointing

    from nemo_anchor.parallel.distributed import ensure_initialized

    weights = checkpoint / "weights"
    if config is None:
        model_yaml = checkpoint / "context" / "model.yaml"
        try:
            nemo = yaml.safe_load(model_yaml.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ValueError(f"{model_yaml}: cannot read the model config ({type(err).__name__}: {err})") from None
        if not isinstance(nemo.get("config"), dict):
            raise ValueError(f"{model_yaml}: no 'config' section")
        config = model_config_from_megatron(nemo["config"], source=str(model_yaml))
    if not (weights / "metadata.json").is_file():
        raise FileNotFoundError(f"not a NeMo 2 checkpoint (no weights/metadata.json): {checkpoint}")
    ensure_initialized()  # dist_checkpointing reads through torch.distributed, even for one process
    metadata = dist_checkpointing.load_tensors_metadata(str(weights))
    shapes = {key[len("module."):]: torch.empty(sharded.global_shape, device="meta")
              for key, sharded in metadata.items() if key.startswith("module.")}
    state = canonical_state(shapes, config.num_layers, source=str(weights))
    embedding = state.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ValueError(f"{weights}: no embedding.word_embeddings.weight among the weights")
    check_state(state, config, embedding.shape[0], source=str(weights))
    return config


def nemo2_tokenizer_dir(checkpoint: Path) -> Optional[Path]:
    """The HF tokenizer a NeMo 2 checkpoint directory carries in its ``context/`` (None: none found)."""
    model_yaml = checkpoint / "context" / "model.yaml"
    try:
        tokenizer = (yaml.safe_load(model_yaml.read_text()) or {}).get("tokenizer")
    except (OSError, yaml.YAMLError):
        tokenizer = None
    return _nemo2_tokenizer_dir(checkpoint / "context", tokenizer if isinstance(tokenizer, dict) else None)


def _nemo2_tokenizer_dir(context: Path, tokenizer: Optional[dict]) -> Optional[Path]:
    """NeMo copies an HF tokenizer into ``context/`` as an artifact named by ``pretrained_model_name``."""
    name = (tokenizer or {}).get("pretrained_model_name")
    candidates = [context / name] if isinstance(name, str) and not Path(name).is_absolute() else []
    for candidate in candidates + [context / "nemo_tokenizer"]:
        if find_tokenizer_dir(candidate) is not None:
            return candidate
    return None


def _read_nemo_anchor(path: Path) -> LoadedCheckpoint:
    from nemo_anchor.checksums import verified_checkpoint
    from nemo_anchor.run_dir import run_dir_of

    ckpt_dir = verified_checkpoint(path)
    config = _nemo_anchor_config(ckpt_dir)
    tensors = read_dist_checkpoint(ckpt_dir, prefix="model.")
    # a bf16 run saves bf16 parameters; their fp32 masters are in the optimizer state
    tensors.update(read_dist_checkpoint(ckpt_dir, prefix=f"{MASTER_PREFIX}model.", required=False))
    state = canonical_state(tensors, config.num_layers, source=str(ckpt_dir))
    # layout: OUTPUT_DIR/checkpoints/iter_NNNNNNN, tokenizer in OUTPUT_DIR/tokenizer
    return _checked(ckpt_dir, NEMO_ANCHOR, config, state, find_tokenizer_dir(run_dir_of(ckpt_dir).tokenizer))


def _nemo_anchor_config(ckpt_dir: Path) -> ModelConfig:
    from nemo_anchor.run_dir import read_run_config

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), read_run_config(ckpt_dir).model))
    except OmegaConfBaseException as err:
        raise ValueError(f"{ckpt_dir / 'config.yaml'}: invalid model section: {err.msg} "
                         f"(key: model.{err.full_key})") from None


def _checked(path, kind, config, state, tokenizer_dir) -> LoadedCheckpoint:
    embedding = state.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ValueError(f"{path}: no embedding.word_embeddings.weight among the weights")
    vocab_size = embedding.shape[0]
    check_state(state, config, vocab_size, source=str(path))
    return LoadedCheckpoint(path, kind, config, vocab_size, state, tokenizer_dir)


def find_tokenizer_dir(path: Path) -> Optional[Path]:
    """``path`` if it holds HF tokenizer files, else None."""
    return path if any((path / name).is_file() for name in _TOKENIZER_FILES) else None


def read_dist_checkpoint(ckpt_dir: Path, *, prefix: str, required: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of a Megatron ``dist_checkpointing`` directory, whole, prefix removed
    (none: ValueError, or ``{}`` when not ``required``)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from nemo_anchor.parallel.distributed import ensure_initialized

    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"not a dist_checkpointing directory (no metadata.json): {ckpt_dir}")
    ensure_initialized()  # dist_checkpointing reads through torch.distributed, even for one process
    try:
        metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
        wanted = {key: sharded for key, sharded in metadata.items() if key.startswith(prefix)}
        if not wanted and not required:
            return {}
        if not wanted:
            found = sorted({key.split(".")[0] + "." for key in metadata})
            raise ValueError(f"{ckpt_dir}: no tensors under '{prefix}' (found prefixes {found})")
        loaded = dist_checkpointing.load(wanted, str(ckpt_dir), validate_access_integrity=False)
    except ValueError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(err, CheckpointException):  # its str() is a traceback per rank; name the first cause
            err = next(iter(err.failures.values()))[0]
        raise ValueError(f"{ckpt_dir}: corrupt or unreadable checkpoint ({type(err).__name__}: {err})") from None
    # `load` merges the checkpoint's common (non-sharded) state in: optimizer, sampler, RNG
    return {key[len(prefix):]: tensor for key, tensor in loaded.items() if key.startswith(prefix)}
