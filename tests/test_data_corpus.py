"""The embedded stdlib corpus and the demo flow: corpus -> pack with a trained BPE -> dataset."""
import ast
import json
import sysconfig
from pathlib import Path

from nemo_anchor.data import PackedDataset, PackOptions, load_tokenizer, pack
from nemo_anchor.data.corpus import build_stdlib_corpus, render_docstrings


def fake_stdlib(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "pkg" / "__init__.py").write_text('"""The package."""\n')
    (root / "pkg" / "mod.py").write_text(
        '"""Module doc."""\n\nclass Thing(Base):\n    """A thing."""\n\n    def run(self, x=1):\n'
        '        """Run it."""\n        return x\n\ndef helper():\n    return 2\n')
    (root / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\nname = '\xe9t\xe9'\n")
    (root / "broken.py").write_text("def f(:\n")
    (root / "undecodable.py").write_bytes(b"x = '\xff'\n")
    (root / "site-packages" / "third.py").write_text("'''Not stdlib.'''\n")
    return root


def read_records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_corpus_has_code_and_docs_from_sources(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    counts = build_stdlib_corpus(tmp_path / "a.jsonl", root=root)
    build_stdlib_corpus(tmp_path / "b.jsonl", root=root)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()  # deterministic
    records = read_records(tmp_path / "a.jsonl")
    from pydoc_data.topics import topics

    docs_topics = [r for r in records if r["path"].startswith("topic:")]
    assert [r["text"] for r in docs_topics] == [topics[name] for name in sorted(topics)]
    assert [r["path"] for r in records[:3]] == ["broken.py", "topic:" + sorted(topics)[0], "latin.py"]  # in turn
    files = [r for r in records if not r["path"].startswith("topic:")]
    assert [(r["path"], r["domain"], r["group"]) for r in files] == [
        ("broken.py", "code", "broken"),
        ("latin.py", "code", "latin"),
        ("pkg/__init__.py", "code", "pkg"), ("pkg/__init__.py", "docs", "pkg"),
        ("pkg/mod.py", "code", "pkg.mod"), ("pkg/mod.py", "docs", "pkg.mod"),
    ]
    assert files[1]["text"] == "# -*- coding: latin-1 -*-\nname = 'été'\n"
    mod_docs = files[5]["text"]
    for expected in ("Module doc.", "class Thing(Base)", "    A thing.", "    def run(self, x=1)", "        Run it."):
        assert expected in mod_docs
    assert "helper" not in mod_docs  # no docstring, nothing to document
    assert counts["code"]["documents"] == 4 and counts["docs"]["documents"] == len(topics) + 2


def test_size_cap_and_real_stdlib(tmp_path):
    counts = build_stdlib_corpus(tmp_path / "corpus.jsonl", max_bytes=600_000)
    records = read_records(tmp_path / "corpus.jsonl")
    total = sum(len(r["text"].encode()) for r in records)
    assert total <= 600_000 and total == sum(c["bytes"] for c in counts.values())
    assert {r["domain"] for r in records} == {"code", "docs"}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = next(r for r in records if r["domain"] == "code")
    assert (stdlib / code["path"]).read_text(encoding="utf-8") == code["text"]
    docs = next(r for r in records if r["domain"] == "docs" and r["group"] == code["group"])
    module_doc = ast.get_docstring(ast.parse(code["text"]))
    assert module_doc and module_doc.splitlines()[0] in docs["text"]
    assert render_docstrings("m", "x = (") is None


def test_demo_flow_pack_stdlib_corpus_with_trained_bpe(tmp_path):
    build_stdlib_corpus(tmp_path / "corpus.jsonl", max_bytes=400_000)
    stats = pack([tmp_path / "corpus.jsonl"], "train-bpe:1024", tmp_path / "data",
                 PackOptions(seq_length=256, valid_fraction=0.2, shuffle=True))
    train, valid = PackedDataset(tmp_path / "data"), PackedDataset(tmp_path / "data" / "valid")
    assert set(stats["splits"]["train"]["domains"]) == {"code", "docs"}
    records = read_records(tmp_path / "corpus.jsonl")
    train_groups = {records[i]["group"] for i in train.document_sources}
    assert not train_groups & {records[i]["group"] for i in valid.document_sources}  # a module's code and docs together
    tokenizer = load_tokenizer(tmp_path / "data")
    assert tokenizer.vocab_size == 1024 and train[0]["tokens"][0] == tokenizer.anchor_id == tokenizer.bos_id
