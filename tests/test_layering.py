"""The import picture of pyengine's Python layers (docs/architecture.md): no module imports
one of a higher layer at module level, and there is no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pyengine

# Lowest first: a module may import its own layer and those before it.
LAYERS = [
    (
        "base",
        [
            "_C",
            "ops",
            "config",
            "outputs",
            "sampling_params",
            "spec_decode",
            "step_values",
            "tokenizer",
            "utils",
        ],  # fmt: skip
    ),
    ("distributed", ["distributed"]),
    ("layers", ["layers"]),
    ("models", ["models"]),
    ("loader", ["loader"]),
    ("sample", ["sample"]),
    ("lora", ["lora"]),
    ("worker", ["worker"]),
    ("executor", ["executor"]),
    ("engine", ["engine"]),
    ("entrypoints", ["entrypoints"]),
]
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}
ROOT = Path(pyengine.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """pyengine modules `path` imports when it is imported (not inside functions, not
    under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pyengine"):
            if node.module == "pyengine":  # from pyengine import _C, ops, Scheduler...
                for alias in node.names:
                    sub = ROOT / alias.name
                    is_module = sub.with_suffix(".py").exists() or sub.is_dir()
                    found.add(f"pyengine.{alias.name}" if is_module else "pyengine._C")
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pyengine"))
    return found


def layer_of(module: str) -> int:
    return RANK[module.split(".")[1]]


def graph() -> dict[str, set[str]]:
    return {
        module_name(path): top_level_imports(path)
        for path in ROOT.rglob("*.py")
        if module_name(path) != "pyengine"  # the package's facade re-exports the API
    }


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in graph().items()
        for target in targets
        if target != "pyengine" and layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_every_module_has_a_layer() -> None:
    assert all(module.split(".")[1] in RANK for module in graph())
