"""Tokenizers: byte round trip, BPE training, HF loading, anchor choice."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_anchor.data import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe_tokenizer

BYTE = byte_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_ids_are_utf8_bytes_and_round_trip(text):
    ids = BYTE.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert BYTE.decode(ids) == text


def test_byte_tokenizer_specials_and_text_that_looks_special():
    assert (BYTE.bos_id, BYTE.eos_id, BYTE.pad_id, BYTE.anchor_id, BYTE.vocab_size) == (256, 257, 258, 256, 259)
    text = "<s>doc</s><pad> \x00\xff"
    assert BYTE.encode(text) == list(text.encode())  # markup inside documents stays text
    assert BYTE.encode_batch([text, "", "é"]) == [list(text.encode()), [], [195, 169]]


def test_saved_tokenizers_load_offline_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    texts = [f"def function_{i}(x):\n    return x * {i}  # café\n" for i in range(200)]
    bpe = train_bpe_tokenizer(texts, vocab_size=400)
    for name, tokenizer in [("byte", BYTE), ("bpe", bpe)]:
        tokenizer.save(tmp_path / name)
        hf = AutoTokenizer.from_pretrained(str(tmp_path / name), local_files_only=True)
        ours = load_tokenizer(tmp_path / name)
        sample = texts[7] + " ünïcödé"
        assert hf.encode(sample, add_special_tokens=False) == tokenizer.encode(sample) == ours.encode(sample)
        assert hf.encode(sample)[0] == tokenizer.bos_id  # HF users get the anchor first, as in training
        assert hf.decode(tokenizer.encode(sample)) == sample
        assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == \
            (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size)


def test_bpe_training_is_deterministic_and_compresses():
    texts = [f"import os\nprint(os.path.join('a', 'b{i}'))\n" for i in range(300)]
    first, second = train_bpe_tokenizer(texts, 320), train_bpe_tokenizer(iter(texts), 320)
    assert first.hf.backend_tokenizer.to_str() == second.hf.backend_tokenizer.to_str()
    assert first.vocab_size == 320 and (first.bos_id, first.eos_id, first.pad_id) == (0, 1, 2)
    ids = first.encode(texts[5])
    assert len(ids) < len(texts[5].encode()) / 2 and first.decode(ids) == texts[5]
    with pytest.raises(ValueError, match="below 259"):
        train_bpe_tokenizer(texts, 100)


def test_tokenizer_without_bos_anchors_on_eos(tmp_path):
    """Qwen has no BOS: the paper uses EOS as the shared anchor (Section 5.3)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2, "[UNK]": 3}, "[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(str(tmp_path / "qwenish"))
    tokenizer = load_tokenizer(tmp_path / "qwenish")
    assert (tokenizer.bos_id, tokenizer.anchor_id, tokenizer.eos_id, tokenizer.pad_id) == (None, 2, 2, 2)

    only_bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>")
    tokenizer = Tokenizer(only_bos, "only-bos")
    assert (tokenizer.anchor_id, tokenizer.eos_id) == (2, 2)


def test_bare_tokenizer_json_gets_its_special_tokens_by_name(tmp_path):
    BYTE.save(tmp_path / "bare")
    for config in ("tokenizer_config.json", "special_tokens_map.json"):  # transformers 5 writes no special_tokens_map
        (tmp_path / "bare" / config).unlink(missing_ok=True)
    bare = load_tokenizer(tmp_path / "bare")
    assert (bare.bos_id, bare.eos_id, bare.pad_id, bare.vocab_size) == (256, 257, 258, 259)
    assert bare.encode("</s> ok") == BYTE.encode("</s> ok")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="expected 'byte' or a local Hugging Face tokenizer directory"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load a Hugging Face tokenizer from .*empty"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="cannot load .*broken/tokenizer.json"):
        load_tokenizer(tmp_path / "broken")
