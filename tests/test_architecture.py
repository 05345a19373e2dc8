"""The house as drawn from its imports: layers that only look down, no circle, each framework behind its own door.

Every ``import`` statement of every ``nemo_anchor`` module counts, the ones inside functions too (a lazy
import is still a dependency). Read from the source with ``ast``; nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_anchor"

# Lowest first. A module may import its own layer and the layers below it, never one above.
# Top-level modules (nemo_anchor/atomic.py ...) are named by their file; subpackages by their folder.
LAYERS = (
    # shared utilities; launch: what the training process's devices decide
    ("atomic", "cache", "checksums", "command", "compat", "cpu_bf16", "gpu", "hf_dir", "launch", "run_dir",
     "run_lease"),
    ("attention", "data"),  # the functional attention API; files -> packed windows (no Megatron)
    ("parallel",),  # process groups, context parallelism, Megatron-Core's CPU shims
    ("model",),  # AnchorCoreAttention, layer specs, the GPT builder
    ("convert",),  # one model's weights and config across formats (HF, Megatron, NeMo 2, ours)
    ("training",),  # Megatron-Core's engine, the forward step, checkpoints, planner, metrics; our trainer
    ("export",),  # export-hf / import-hf, inference loading
    ("evaluation",),
    ("analysis",),  # the probe (uses evaluation's loaders)
    ("nemo", "bridge", "ablation"),  # front doors and the ablation tool: adapters over what is below
    ("cli", "gpu_check", "__init__"),  # entry points
)
# Siblings in one layer that must not import each other: the front doors share only what is below them.
INDEPENDENT = {"nemo", "bridge", "ablation"}
# Only these parts may import a framework: the rest of the package runs without it.
FRAMEWORK_OWNERS = {"nemo": {"nemo"}, "lightning": {"nemo"}, "nemo_run": {"nemo"}, "megatron.bridge": {"bridge"}}
# Our trainer's own door (its loop and CLI): NeMo and Bridge reuse the parts below it, never the door itself.
TRAINER_DOOR = {"nemo_anchor.training.loop", "nemo_anchor.training.cli"}
NO_MEGATRON = {"attention", "data"}  # and no torch.distributed: they run in any process, on any stack


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; ``from X import y`` names X.y when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                child = f"{module}.{alias.name}"
                found.append((child if child in MODULES else module, node.lineno))
    return found


def _part(module: str) -> str:
    """The room a ``nemo_anchor`` module lives in: its subpackage, or its own file at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _internal_edges() -> list[tuple[str, str, int]]:
    return [(name, imported, line) for name, path in MODULES.items() for imported, line in _imports(name, path)
            if imported.split(".")[0] == "nemo_anchor" and imported != name]


LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def test_every_part_of_the_package_has_a_layer():
    assert {_part(name) for name in MODULES} - set(LAYER_OF) == set(), "add the new part to LAYERS"


def test_imports_never_run_back_up():
    upward = [f"{MODULES[a].relative_to(PACKAGE.parent)}:{line} imports {b}"
              for a, b, line in _internal_edges()
              if LAYER_OF[_part(b)] > LAYER_OF[_part(a)]
              or (_part(a) != _part(b) and {_part(a), _part(b)} <= INDEPENDENT)]
    assert upward == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("level", ["module", "part"])
def test_no_import_circle(level):
    graph: dict[str, set[str]] = {}
    for a, b, _ in _internal_edges():
        b = b if b in MODULES else b.rpartition(".")[0]  # `import nemo_anchor.x.y as z` where y is a name
        if level == "part":
            a, b = _part(a), _part(b)
        if a != b:
            graph.setdefault(a, set()).add(b)
    assert _cycle(graph) is None


def test_each_framework_is_imported_behind_its_own_door():
    strays = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
              for name, path in MODULES.items() for imported, line in _imports(name, path)
              for framework, owners in FRAMEWORK_OWNERS.items()
              if (imported == framework or imported.startswith(framework + ".")) and _part(name) not in owners]
    assert strays == []


def test_nemo_and_bridge_are_adapters_over_shared_parts_not_over_our_trainer():
    strays = [f"{MODULES[a].relative_to(PACKAGE.parent)}:{line} imports {b}"
              for a, b, line in _internal_edges() if _part(a) in ("nemo", "bridge") and b in TRAINER_DOOR]
    assert strays == []


def test_attention_and_data_know_nothing_of_megatron_or_torch_distributed():
    strays = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
              for name, path in MODULES.items() if _part(name) in NO_MEGATRON
              for imported, line in _imports(name, path)
              if imported.split(".")[0] == "megatron" or imported.startswith("torch.distributed")]
    assert strays == []


def test_the_rules_catch_what_they_forbid(tmp_path):
    """The checks above are not vacuous: the circle finder finds a circle and the edges see lazy imports."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from nemo_anchor.export.hf import export_hf\n    import megatron.bridge\n")
    assert _imports("nemo_anchor.training.lazy", lazy) == [("nemo_anchor.export.hf", 2), ("megatron.bridge", 3)]
