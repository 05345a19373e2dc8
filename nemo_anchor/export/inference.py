"""Load a trained model for inference: our Megatron model, or the equivalent transformers model.

Unpacked input is one document per row, starting at position 0: AnchorAttention, intra-document
and full attention all reduce to plain causal attention there, so no packing metadata is needed.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nemo_anchor.convert.megatron_state import build_model, load_into_model
from nemo_anchor.convert.sources import HF, checkpoint_kind, find_tokenizer_dir, read_checkpoint
from nemo_anchor.model.config import ModelConfig


class CausalLM(torch.nn.Module):
    """A Megatron ``GPTModel`` behind a plain causal-LM call.

    ``model(tokens)``: ``tokens`` ``[B, T]`` int64 -> logits ``[B, T, V]`` float32 on the CPU, each
    row one sequence with positions ``0..T-1``. Gradients flow unless the caller disables them.
    """

    def __init__(self, gpt: torch.nn.Module, config: ModelConfig, vocab_size: int, tokenizer=None):
        super().__init__()
        self.gpt = gpt
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # transformers tokenizer, or None when the checkpoint has none

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            described = f"{tuple(tokens.shape)} {tokens.dtype}" if torch.is_tensor(tokens) else type(tokens).__name__
            raise ValueError(f"tokens must be a [B, T] int64 tensor, got {described}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{int(tokens.min())}, "
                             f"{int(tokens.max())}]")
        device = next(self.gpt.parameters()).device
        tokens = tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        logits = self.gpt(input_ids=tokens, position_ids=positions, attention_mask=None)
        return logits.float().cpu()


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Our Megatron model from a training output_dir, a checkpoint directory, a NeMo 2 or an HF directory.

    Weights are cast to ``dtype`` (float32 or bfloat16); logits come back as float32.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    ckpt = read_checkpoint(path)
    gpt = build_model(ckpt.config, ckpt.vocab_size)
    load_into_model(gpt, ckpt.state, source=str(ckpt.path))
    tokenizer = None
    if ckpt.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ckpt.tokenizer_dir)
    return CausalLM(gpt.to(dtype).eval(), ckpt.config, ckpt.vocab_size, tokenizer)


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """``(transformers model in eval mode, tokenizer or None)`` for any directory ``load_checkpoint`` accepts.

    An HF directory loads as it is; our and NeMo 2 checkpoints are converted in memory, exactly
    as ``export-hf`` would write them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_anchor.export.hf import to_hf_model

    if checkpoint_kind(path) != HF:
        return to_hf_model(read_checkpoint(path), dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer_dir = find_tokenizer_dir(Path(path))
    return model.eval(), None if tokenizer_dir is None else AutoTokenizer.from_pretrained(tokenizer_dir)
