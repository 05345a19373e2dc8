"""The embedded demo corpus, built offline from what every Python installation ships.

Two domains, written as JSONL records ``{"text", "domain", "group", "path"}``:

- ``code``: every ``.py`` file of the standard library (``sysconfig.get_paths()["stdlib"]``, third-party
  ``site-packages`` excluded), decoded with its coding cookie;
- ``docs``: the language reference topics that ``pydoc`` renders (``pydoc_data.topics``) and each
  module's documentation rendered from its docstrings (module, classes, functions, with signatures),
  read with ``ast`` so that no module is imported (importing ``antigravity`` opens a browser).

A module's code and docs share a ``group`` (its dotted name): the docstrings appear verbatim in the
code, so ``pack --valid-fraction`` holds out whole modules and held-out loss stays honest. The output
is deterministic for a given Python installation; ``max_bytes`` caps the total UTF-8 text size.

Usage: ``python -m nemo_anchor.data.corpus --output corpus.jsonl [--max-bytes N]``.
"""
from __future__ import annotations

import argparse
import ast
import itertools
import json
import multiprocessing
import sysconfig
import tokenize
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

from nemo_anchor.atomic import atomic_file

CODE, DOCS = "code", "docs"
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
FILES_PER_ROUND = 64


def stdlib_documents(root: str | Path | None = None) -> Iterator[dict]:
    """Corpus records in a fixed order: each module's code and docs, then one pydoc topic, in turn
    (so that a size cap keeps both domains)."""
    from pydoc_data.topics import topics

    topic_records = ({"text": topics[name], "domain": DOCS, "group": f"pydoc_data.topics:{name}",
                      "path": f"topic:{name}"} for name in sorted(topics))
    for module_records, topic in itertools.zip_longest(_module_records_in_order(root), topic_records):
        yield from module_records or []
        if topic is not None:
            yield topic


def _module_records_in_order(root: str | Path | None) -> Iterator[list[dict]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    paths = [path for path in sorted(root.rglob("*.py")) if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts)]
    # forkserver: a fork of a process whose torch/OpenMP threads are running can crash in the child
    with ProcessPoolExecutor(mp_context=multiprocessing.get_context("forkserver")) as pool:  # map keeps the order
        for first in range(0, len(paths), FILES_PER_ROUND):  # in rounds, so a size cap stops the work early
            chunk = paths[first:first + FILES_PER_ROUND]
            yield from pool.map(_module_records, chunk, [root] * len(chunk), chunksize=8)


def _module_records(path: Path, root: Path) -> list[dict]:
    """The code record of one source file and, when it has docstrings, its docs record."""
    relative = path.relative_to(root)
    try:
        with tokenize.open(path) as source_file:  # honours PEP 263 coding cookies
            source = source_file.read()
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError):
        return []  # the stdlib's tests ship deliberately undecodable files
    if not source.strip():
        return []
    module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
    records = [{"text": source, "domain": CODE, "group": module, "path": str(relative)}]
    documentation = render_docstrings(module, source)
    if documentation:
        records.append({"text": documentation, "domain": DOCS, "group": module, "path": str(relative)})
    return records


def render_docstrings(module: str, source: str) -> str | None:
    """pydoc-like text of a module's docstrings (None when it has none or does not parse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old sources
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines: list[str] = []

    def document(node: ast.AST, indent: str) -> None:
        for child in node.body:
            if isinstance(child, ast.ClassDef):
                bases = ", ".join(ast.unparse(base) for base in child.bases)
                header = f"class {child.name}({bases})" if bases else f"class {child.name}"
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                header = f"def {child.name}({ast.unparse(child.args)})"
            else:
                continue
            docstring = ast.get_docstring(child)
            if docstring:
                lines.extend(["", indent + header, *(indent + "    " + line for line in docstring.splitlines())])
            if isinstance(child, ast.ClassDef):
                document(child, indent + "    ")

    document(tree, "")
    module_doc = ast.get_docstring(tree)
    if not module_doc and not lines:
        return None
    return "\n".join([f"Help on module {module}:", "", "NAME", f"    {module}", "", "DESCRIPTION",
                      *("    " + line for line in (module_doc or "").splitlines()), *lines]) + "\n"


def build_stdlib_corpus(output: str | Path, max_bytes: int | None = None, root: str | Path | None = None) -> dict:
    """Write the corpus JSONL to ``output`` (atomically).

    Args:
        max_bytes: stop before the first document that would take the text past this many UTF-8 bytes.

    Returns:
        ``{domain: {"documents": n, "bytes": b}}``.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    documents, sizes, total = Counter(), Counter(), 0
    with atomic_file(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for record in stdlib_documents(root):
            try:
                size = len(record["text"].encode("utf-8"))
            except UnicodeEncodeError:
                continue  # a docstring whose escapes make a lone surrogate has no UTF-8 form
            if max_bytes is not None and total + size > max_bytes:
                break
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            documents[record["domain"]] += 1
            sizes[record["domain"]] += size
            total += size
    return {domain: {"documents": documents[domain], "bytes": sizes[domain]} for domain in sorted(documents)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_anchor.data.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-bytes", type=int, default=None, help="cap on the total text size in bytes")
    args = parser.parse_args(argv)
    for domain, counts in build_stdlib_corpus(args.output, args.max_bytes).items():
        print(f"{domain}: {counts['documents']} documents, {counts['bytes'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
