"""Every way into ``AnchorCoreAttention`` against a float64 oracle of the masks' definition.

- our ``AnchorPackedSeqParams`` (``make_packed_seq_params``): documents and windows;
- Megatron's plain ``PackedSeqParams`` as Megatron-LM's THD training builds them
  (``megatron.core.utils.get_thd_batch_on_this_cp_rank``): one segment per document over the micro-batch's
  pack, padded (``cu_seqlens_q_padded``) or not, tokens after the last one included; the pack is one window,
  its first token the anchor; under context parallelism only ``intra_doc`` runs on them;
- unpacked sbhd batches: each row one window of one document.

Megatron-Bridge's packed batches: tests/bridge/test_bridge_packed_params.py; NeMo's: tests/test_nemo.py.
Megatron's plain params restart RoPE at every document: the ``anchor`` and ``full`` masks warn once per process.
About 8 CPU seconds.
"""
import logging

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_thd_batch_on_this_cp_rank

from nemo_anchor.attention import layout as layout_module
from nemo_anchor.attention.layout import boundaries as read_boundaries
from nemo_anchor.model import core_attention, packed_seq
from nemo_anchor.model.packed_seq import make_packed_seq_params, packed_layout
from nemo_anchor.parallel.distributed import initialize_parallel

from core_attention_oracle import VOCAB, core_attentions, expected_output, qkv, tiny_model  # tests/

MASKS = ("full", "intra_doc", "anchor")  # attention types whose mask is their name


@pytest.fixture(scope="module", autouse=True)
def parallel():
    return initialize_parallel()


@pytest.fixture(scope="module")
def cores():
    return {mask: core_attentions(tiny_model(mask))[0] for mask in MASKS}


def megatron_lm_params(cu_seqlens, cu_seqlens_padded=None):
    """What Megatron-LM's packed (THD) training hands the model for one micro-batch (context parallel size 1)."""
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    padded = cu if cu_seqlens_padded is None else torch.tensor(cu_seqlens_padded, dtype=torch.int32)
    lengths = cu[1:] - cu[:-1]
    batch = {"tokens": torch.zeros(1, int(padded[-1]), dtype=torch.long)}
    _, params = get_thd_batch_on_this_cp_rank(batch, cu, padded, lengths.max().reshape(1), cp_size=1, cp_rank=0)
    return params


def plain(cu_seqlens):
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16, max_seqlen_kv=16)


# (params, tokens, documents, windows): what each input means
INPUTS = {
    "megatron_lm_thd": lambda: (megatron_lm_params([0, 5, 12, 13, 20, 32]), 32, (0, 5, 12, 13, 20, 32), (0, 32)),
    # documents of 5, 5, 7 tokens padded to 8 each (context parallelism's multiples of 2cp): the tokens
    # lie at the padded boundaries
    "megatron_lm_thd_padded": lambda: (megatron_lm_params([0, 5, 10, 17], [0, 8, 16, 24]), 24, (0, 8, 16, 24),
                                       (0, 24)),
    # tokens after the last boundary (Megatron's total_tokens beyond the sequences): one more document
    "plain_with_trailing_tokens": lambda: (plain([0, 5, 12]), 16, (0, 5, 12, 16), (0, 16)),
    "ours": lambda: (make_packed_seq_params(torch.tensor([0, 5, 12, 20, 32, 33, 40, 64], dtype=torch.int32),
                                            torch.tensor([0, 32, 64], dtype=torch.int32), "anchor"),
                     64, (0, 5, 12, 20, 32, 33, 40, 64), (0, 32, 64)),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("source", sorted(INPUTS))
def test_packed_input_meets_its_definition(cores, source, mask):
    params, tokens, docs, windows = INPUTS[source]()
    q, k, v = qkv(tokens)
    out = cores[mask](q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out.double(), expected_output(q, k, v, docs, windows, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", MASKS)
def test_sbhd_rows_are_windows_of_one_document(cores, mask):
    rows, length = 3, 12
    q, k, v = qkv(rows * length)
    sbhd = [x.unflatten(0, (rows, length)).transpose(0, 1) for x in (q, k, v)]  # [s, b, heads, head_dim]
    out = cores[mask](*sbhd, None)
    bounds = tuple(range(0, (rows + 1) * length, length))
    expected = expected_output(q, k, v, bounds, bounds, mask).unflatten(0, (rows, length)).transpose(0, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_megatron_lm_packed_micro_batch_through_gpt_model_reads_its_boundaries_once(monkeypatch):
    """A real GPTModel forward (our layer spec, 3 layers) on Megatron-LM's THD micro-batch: every layer's core
    attention computes AnchorAttention over the pack, and reads the boundaries to the host once per micro-batch
    for all layers (the unfused RoPE of plain params still reads them in every layer, as Megatron's does)."""
    reads = []

    def counting(*args):
        reads.append(args)
        return read_boundaries(*args)

    for module in (layout_module, packed_seq):
        monkeypatch.setattr(module, "boundaries", counting, raising=False)
    model = tiny_model("anchor", num_layers=3)
    seen = []
    for core in core_attentions(model):
        core.register_forward_hook(lambda module, args, kwargs, out: seen.append((args[:3], out)), with_kwargs=True)
    docs = (0, 3, 11, 12, 25, 32)
    tokens = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    for micro_batch in (1, 2):
        params = megatron_lm_params(list(docs))
        model(input_ids=tokens, position_ids=torch.arange(32)[None], attention_mask=None, packed_seq_params=params)
        assert len(reads) == micro_batch
    assert len(seen) == 6
    for (q, k, v), out in seen:
        torch.testing.assert_close(out.double(), expected_output(q, k, v, docs, (0, 32), "anchor"), atol=1e-5,
                                   rtol=1e-5)


def test_plain_params_are_read_again_when_their_boundaries_change():
    params = plain([0, 5, 12, 16])
    assert packed_layout(params, 16, "anchor").doc_bounds == (0, 5, 12, 16)
    params.cu_seqlens_q[1] = 7  # rewritten in place: Megatron's data step reuses no tensor, but nothing forbids it
    assert packed_layout(params, 16, "anchor").doc_bounds == (0, 7, 12, 16)
    params.cu_seqlens_q = torch.tensor([0, 2, 16], dtype=torch.int32)
    assert packed_layout(params, 16, "anchor").doc_bounds == (0, 2, 16)


def test_plain_params_beyond_the_pack_are_refused():
    with pytest.raises(ValueError, match=r"PackedSeqParams.cu_seqlens_q ends at 16, beyond the 12 tokens of the pack"):
        packed_layout(plain([0, 5, 16]), 12, "anchor")


class _ContextParallelGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


@pytest.mark.parametrize("mask", ["full", "anchor"])
def test_plain_params_under_context_parallelism_refuse_every_mask_but_intra_doc(cores, monkeypatch, mask):
    """Megatron splits a plain pack across the ranks document by document (chunks r and 2cp-1-r of each), and our
    context-parallel attention takes each unit so split as a window: the anchor would be lost."""
    monkeypatch.setattr(cores[mask].pg_collection, "cp", _ContextParallelGroup(2))
    q, k, v = qkv(16)
    with pytest.raises(ValueError, match=rf"the {mask} mask under context parallelism \(cp=2\) needs each window's "
                                         r"boundaries, .*make_packed_seq_params") as error:
        cores[mask](q, k, v, None, packed_seq_params=plain([0, 8, 24, 32]))
    assert "\n" not in str(error.value)
    # intra_doc runs: each document, the unit Megatron split, is one window to the context-parallel attention
    layout = packed_layout(plain([0, 8, 24, 32]), 32, "intra_doc", cp_size=2)
    assert layout.window_bounds == layout.doc_bounds == (0, 8, 24, 32)


def _rope_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("nemo_anchor") and "RoPE" in r.getMessage()]


@pytest.mark.parametrize("mask", ["full", "anchor"])
def test_plain_params_warn_once_that_rope_restarts_at_every_document(cores, monkeypatch, caplog, mask):
    """Megatron's RoPE restarts per cu_seqlens_q segment (a document of plain params); anchor and full define the
    positions continuous over the window: said once per process, with the way to keep them continuous."""
    monkeypatch.setattr(core_attention, "_WARNED_PLAIN_ROPE", False)
    q, k, v = qkv(16)
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        for _ in range(2):
            cores[mask](q, k, v, None, packed_seq_params=plain([0, 5, 12, 16]))
        cores["intra_doc" if mask == "full" else "full"](q, k, v, None, packed_seq_params=plain([0, 5, 12, 16]))
    [warning] = _rope_warnings(caplog)
    assert f"the {mask} mask got Megatron's plain PackedSeqParams" in warning and "restart at every document" in warning
    assert "nemo_anchor.model.packed_seq.make_packed_seq_params" in warning


@pytest.mark.parametrize("source, mask", [("plain", "intra_doc"), ("ours", "anchor")])
def test_no_rope_warning_where_the_positions_are_what_the_paradigm_defines(cores, monkeypatch, caplog, source, mask):
    monkeypatch.setattr(core_attention, "_WARNED_PLAIN_ROPE", False)
    params, tokens = (plain([0, 5, 12, 16]), 16) if source == "plain" else INPUTS["ours"]()[:2]
    q, k, v = qkv(tokens)
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        cores[mask](q, k, v, None, packed_seq_params=params)
    assert not _rope_warnings(caplog)
