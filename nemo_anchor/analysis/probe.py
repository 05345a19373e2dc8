"""The BF16 RoPE probe: Figure 1 of Wang et al. for one model, in bf16, in fp32 and re-initialised.

For each variant the probe averages over sequences:
- ``D``: shift ``Δ1`` -> ``D(X, Δ1, Δ2)`` of Eq. 4 with ``Δ2 = reference_shift`` (Figure 1, left);
- ``per_token``: the per-key differences between ``Δ1 = 0`` and ``Δ2`` (Figure 1, middle);
- ``D_logit``: sequence length -> ``D_logit`` of Eq. 5 between ``0`` and ``Δ2`` (Figure 1, right).

Variants: ``bf16`` and ``fp32`` load the same weights in that dtype; ``random_bf16`` is a seeded
random initialisation of the same configuration in bf16, its linear layers drawn with PyTorch's
default ``kaiming_uniform_`` as in the paper.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from nemo_anchor.analysis.shift_metrics import shift_differences
from nemo_anchor.cpu_bf16 import bf16_matmul_kind, bf16_matmuls_in_fp32
from nemo_anchor.evaluation.corpus import check_token_ids, read_token_windows
from nemo_anchor.evaluation.models import load_model

PAPER_SHIFTS = (0, 2, 4, 6, 8, 10, 12, 14, 15, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000)
PAPER_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
VARIANTS = ("bf16", "fp32", "random_bf16")


@dataclass(frozen=True)
class ProbeSettings:
    """What to measure. The paper uses 50 sequences of 4096 tokens."""

    num_sequences: int = 8
    sequence_length: int = 1024
    shifts: tuple[int, ...] = PAPER_SHIFTS
    reference_shift: int = 16
    lengths: tuple[int, ...] = PAPER_LENGTHS
    max_length: int = 8192
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0

    def __post_init__(self):
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown or not self.variants:
            raise ValueError(f"variants must be a non-empty subset of {VARIANTS}, got {list(self.variants)}")
        if self.num_sequences < 1 or self.sequence_length < 2:
            raise ValueError(f"need >= 1 sequence of >= 2 tokens, got {self.num_sequences} x {self.sequence_length}")
        if min(self.shifts, default=0) < 0 or self.reference_shift < 0:
            raise ValueError(f"shifts must be >= 0, got {list(self.shifts)} and reference {self.reference_shift}")
        if not self.lengths or min(self.lengths) < 2 or self.max_length < 2:
            raise ValueError(f"D_logit lengths and max_length must be >= 2, got lengths {list(self.lengths)} and "
                             f"max_length {self.max_length}")

    def logit_lengths(self, model_max_length: int | None) -> list[int]:
        """The ``D_logit`` lengths kept: at most ``max_length`` and the model's maximum length.

        Raises ValueError when none is left (the message names the lengths and both caps).
        """
        cap = min(self.max_length, model_max_length or self.max_length)
        kept = [length for length in self.lengths if length <= cap]
        if not kept:
            raise ValueError(f"no D_logit length is at most {cap} (max_length {self.max_length}, the model's "
                             f"max_position_embeddings {model_max_length}): got lengths {list(self.lengths)}")
        return kept


def same_weights_in(model, dtype: torch.dtype):
    """A copy of ``model`` in ``dtype``, built as ``from_pretrained(dtype=...)`` builds it.

    ``model.to(dtype)`` would also round the fp32 RoPE ``inv_freq`` buffer, which a model loaded
    in bf16 keeps in fp32; loading the state dict into a fresh model leaves that buffer alone.
    """
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # the throw-away initialisation must not move the caller's RNG
        copy = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    copy.load_state_dict(model.state_dict())
    return copy.to(model.device).eval()


def random_init_copy(config, *, dtype: torch.dtype, seed: int):
    """A randomly initialised model of ``config`` in ``dtype``, reproducible from ``seed``.

    The decoder's linear layers are redrawn with PyTorch's default ``kaiming_uniform_`` (the
    paper's random baseline); embeddings and norms keep the HF initialisation. The global RNG is
    left untouched.
    """
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        for module in model.get_decoder().modules():
            if isinstance(module, torch.nn.Linear):
                module.reset_parameters()
    return model.eval()


def probe_model(
    model, sequences: torch.Tensor, settings: ProbeSettings, logit_lengths: Sequence[int], progress=None
) -> dict:
    """Measure one model on ``sequences`` (int64 ``[N, >= max(sequence_length, *logit_lengths)]``).

    Returns ``{"D": {str(Δ1): float}, "per_token": [float] * sequence_length, "D_logit": {str(T): float}}``,
    each averaged over the N sequences. Per sequence: one pass with every shift at
    ``sequence_length`` tokens, and a second one (shifts 0 and Δ2 only) when a ``D_logit`` length is longer.
    """
    rows = [*settings.shifts, *([] if 0 in settings.shifts else [0])]  # Δ1 = 0 gives the per-token panel
    longest = max(logit_lengths, default=0)
    attention = torch.zeros(len(rows), settings.sequence_length, dtype=torch.float64)
    logit_differences = torch.zeros(len(logit_lengths), dtype=torch.float64)
    for sequence in sequences:
        measured = shift_differences(model, sequence[: settings.sequence_length], rows, settings.reference_shift)
        attention += measured.attention
        logits, row = measured, rows.index(0)
        if longest > settings.sequence_length:
            _advance(progress)
            logits = shift_differences(model, sequence[:longest], [0], settings.reference_shift, attention=False)
            row = 0
        per_length = [logits.D_logit(length)[row].item() for length in logit_lengths]
        logit_differences += torch.tensor(per_length, dtype=torch.float64)
        _advance(progress)
    attention /= len(sequences)
    logit_differences /= len(sequences)
    return {
        "D": {str(shift): attention[index].sum().item() for index, shift in enumerate(settings.shifts)},
        "per_token": attention[rows.index(0)].tolist(),
        "D_logit": {str(length): value.item() for length, value in zip(logit_lengths, logit_differences)},
    }


def run_probe(
    model_path: str | Path, sources: Sequence[str | Path], settings: ProbeSettings, *, device="cpu", text_key="text"
) -> tuple[dict, dict]:
    """Probe every variant of the model at ``model_path`` on sequences read from ``sources``.

    Returns ``(results, metadata)``: ``results[variant]`` is :func:`probe_model`'s mapping, for the
    variants in ``settings.variants``; ``metadata`` records the settings and inputs actually used.
    """
    # One load in fp32 (exact for weights stored in bf16); the bf16 variant is a copy of it.
    pretrained, tokenizer = load_model(model_path, dtype=torch.float32, device=device)
    config = pretrained.config
    logit_lengths = settings.logit_lengths(getattr(config, "max_position_embeddings", None))
    window = max([settings.sequence_length, *logit_lengths])
    sequences = read_token_windows(
        sources, tokenizer, num_windows=settings.num_sequences, length=window, text_key=text_key
    )
    check_token_ids(sequences, config.vocab_size, sources)

    results = {}
    passes_per_sequence = 2 if max(logit_lengths, default=0) > settings.sequence_length else 1
    steps = len(settings.variants) * settings.num_sequences * passes_per_sequence
    with tqdm(total=steps, desc="probe", unit="pass") as progress:
        for variant in settings.variants:
            progress.set_postfix_str(variant)
            if variant == "fp32":
                model = pretrained
            elif variant == "bf16":
                model = same_weights_in(pretrained, torch.bfloat16)
            else:
                model = random_init_copy(config, dtype=torch.bfloat16, seed=settings.seed).to(device)
            with bf16_matmuls_in_fp32(next(model.parameters()).dtype, device):
                results[variant] = probe_model(model, sequences, settings, logit_lengths, progress)
    metadata = {
        "model": str(model_path),
        "inputs": [str(source) for source in sources],
        "settings": asdict(settings),
        "logit_lengths": logit_lengths,
        "device": str(device),
        "bf16_matmuls": bf16_matmul_kind(device),
    }
    return results, metadata


def _advance(progress) -> None:
    if progress is not None:
        progress.update(1)
