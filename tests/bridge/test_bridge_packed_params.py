"""Megatron-Bridge's packed path into ``AnchorCoreAttention`` against the float64 oracle (.venv-bridge).

Bridge's ``gpt_step`` turns a packed batch into Megatron's plain ``PackedSeqParams`` with its own
``get_packed_seq_params``, from either format it reads: its packed fine-tuning batches (``cu_seqlens`` padded
with -1, and ``cu_seqlens_unpadded`` when the sequences are padded) and Megatron-Core's (``cu_seqlens_q``,
``total_tokens``). A user who gives our layer spec to that step gets AnchorAttention over the pack: one window,
its first token the anchor. About 3 CPU seconds. Skipped where Megatron-Bridge is not installed.
"""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

import nemo_anchor.bridge  # noqa: E402,F401 - its CPU shims
from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params  # noqa: E402

from nemo_anchor.parallel.distributed import initialize_parallel  # noqa: E402

from core_attention_oracle import core_attentions, expected_output, qkv, tiny_model  # noqa: E402  tests/


def int32(*rows):
    return torch.tensor(rows, dtype=torch.int32)


# (Bridge's batch, tokens, documents): the pack is one window
BATCHES = {
    "fine_tuning": ({"cu_seqlens": int32([0, 5, 12, 20, 32, -1]), "cu_seqlens_argmin": torch.tensor([[5]]),
                     "max_seqlen": int32([12])}, 32, (0, 5, 12, 20, 32)),
    # sequences of 5, 5 and 7 tokens, each padded to 8: the tokens lie at the padded boundaries
    "fine_tuning_padded": ({"cu_seqlens": int32([0, 8, 16, 24, -1]), "cu_seqlens_argmin": torch.tensor([[4]]),
                            "cu_seqlens_unpadded": int32([0, 5, 10, 17, -1]),
                            "cu_seqlens_unpadded_argmin": torch.tensor([[4]]), "max_seqlen": int32([8])},
                           24, (0, 8, 16, 24)),
    # tokens after the last sequence (total_tokens): one more document
    "megatron_core": ({"cu_seqlens_q": int32([0, 5, 12, 20]), "max_seqlen_q": 8, "total_tokens": 24}, 24,
                      (0, 5, 12, 20, 24)),
}


@pytest.fixture(scope="module")
def cores():
    initialize_parallel()
    return {mask: core_attentions(tiny_model(mask))[0] for mask in ("full", "intra_doc", "anchor")}


@pytest.mark.parametrize("mask", ["full", "intra_doc", "anchor"])
@pytest.mark.parametrize("source", sorted(BATCHES))
def test_bridges_packed_params_meet_the_definition(cores, source, mask):
    batch, tokens, docs = BATCHES[source]
    params = get_packed_seq_params(batch)
    q, k, v = qkv(tokens)
    out = cores[mask](q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out.double(), expected_output(q, k, v, docs, (0, tokens), mask), atol=1e-5, rtol=1e-5)
