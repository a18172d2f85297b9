"""The layer rule of shared/DESIGN.md, read from the source: no import circle between modules,
and no import up the layer order server > api > engine > models > backend > cuda_kernels.

Every import counts: module level, function-local and `if TYPE_CHECKING:` ones.
`errors` and `api_types` are the shared leaves under backend/ (they import no layer).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tf_async", "cuda_kernels")

# module prefix -> layer; the longest matching prefix wins
LAYERS: dict[str, int] = {
    "cuda_kernels": 0,
    "tf_async.errors": 1,
    "tf_async.api_types": 1,
    "tf_async.backend": 2,
    "tf_async.models": 3,
    "tf_async.engine": 4,
    "tf_async.api": 5,
    "tf_async": 5,  # the package's __init__: re-exports the API
    "tf_async.server": 6,
    "tf_async.serving": 6,  # the --replicas front and the Ray app: beside the server
    "tf_async.cli": 6,  # the command line and its tools sit on top, beside the server
    "tf_async.gate": 6,
    "tf_async.bench": 6,
    "tf_async.baseline": 6,
    "tf_async.baseline_cli": 6,
}
KERNEL_DEPENDENCIES = {"numba", "llvmlite", "numpy", "cuda_kernels"}  # llvmlite: numba's own IR


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the two packages."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name the file imports (with `from a import b`: a.b and a), absolute."""
    is_package = path.name == "__init__.py"
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(module, is_package, node.module, node.level)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def resolve(module: str, is_package: bool, name: str | None, level: int) -> str:
    if level == 0:
        assert name is not None
        return name
    parts = module.split(".")
    keep = len(parts) - level + (1 if is_package else 0)
    return ".".join(parts[:keep] + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (names that are not modules are dropped)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = {name for name in imported_names(module, path) if name in files}
        graph[module] = targets - {module}
    return graph


def layer_of(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_module_has_a_layer() -> None:
    assert all(layer_of(module) >= 0 for module in module_files())


def test_no_import_circle() -> None:
    assert find_cycles(import_graph()) == []


def test_no_upward_import() -> None:
    upward = sorted(f"{module} -> {target}" for module, targets in import_graph().items()
                    for target in targets if layer_of(target) > layer_of(module))
    assert upward == []


def test_cuda_kernels_import_only_numba_and_numpy() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for module, path in module_files().items():
        if not module.startswith("cuda_kernels"):
            continue
        for name in imported_names(module, path):
            top = name.split(".")[0]
            if top not in stdlib and top not in KERNEL_DEPENDENCIES:
                bad.append(f"{module} -> {name}")
    assert sorted(set(bad)) == []


def test_the_checker_sees_a_cycle_and_function_local_imports() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = "def f():\n    from ..engine import build\n"
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert resolve("tf_async.models.decoder", False, node.module, node.level) == "tf_async.engine"


def test_only_the_backend_imports_cuda_kernels() -> None:
    """backend/ is the one door to the kernels (DESIGN.md, Layers)."""
    reaching = sorted(f"{module} -> {target}" for module, targets in import_graph().items()
                      for target in targets if target.startswith("cuda_kernels")
                      and not module.startswith(("cuda_kernels", "tf_async.backend")))
    assert reaching == []
