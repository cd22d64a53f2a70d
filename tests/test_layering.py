"""The import picture of pyengine's Python layers (docs/architecture.md): no module imports
one of a higher layer, and there is no import cycle, counting imports inside functions."""

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
            "faults",
            "flat_logprobs",
            "outputs",
            "pooling_params",
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
    ("capi", ["capi", "__main__"]),  # (the C API's side, and python -m pyengine)
]
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}
ROOT = Path(pyengine.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.Module) -> set[int]:
    """The nodes in the body of `if TYPE_CHECKING:` (imports for annotations only; an
    `else:` branch, or `if not TYPE_CHECKING:`, runs)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def _absolute(path: Path, node: ast.ImportFrom) -> str | None:
    """The module a `from ... import` names, a relative one resolved from `path`."""
    if not node.level:
        return node.module
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _is_module(dotted: str) -> bool:
    sub = ROOT.parent.joinpath(*dotted.split("."))
    return sub.with_suffix(".py").exists() or sub.is_dir()


def imports(path: Path) -> set[str]:
    """pyengine modules `path` imports, at module level or inside functions (those under
    TYPE_CHECKING aside): a function's import still makes the two modules depend on each
    other, only later. `from package import module` counts as importing the module."""
    tree = ast.parse(path.read_text())
    type_only = _type_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            if not module or not module.startswith("pyengine"):
                continue
            for alias in node.names:
                name = f"{module}.{alias.name}"
                if _is_module(name):  # from pyengine import ops; from pyengine.layers import x
                    found.add(name)
                else:  # a name in the module (pyengine's own: the _C extension's)
                    found.add("pyengine._C" if module == "pyengine" else module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pyengine"))
    return found


def layer_of(module: str) -> int:
    return RANK[module.split(".")[1]]


def graph() -> dict[str, set[str]]:
    return {
        module_name(path): imports(path)
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
