"""The package arrows point one way: distributed <- data <- envs/models <- algorithms."""

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What each package may depend on (its left-hand neighbours in the architecture).
ALLOWED = {
    "rl-distributed": set(),
    "rl-data": {"rl-distributed"},
    "rl-envs": {"rl-distributed", "rl-data"},
    "rl-models": {"rl-distributed", "rl-data"},
    "rl-algorithms": {"rl-distributed", "rl-data", "rl-envs", "rl-models"},
}


def declared_workspace_deps(package: str) -> set[str]:
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    deps = meta["project"]["dependencies"]
    for extra in meta["project"].get("optional-dependencies", {}).values():
        deps = [*deps, *extra]
    names = {
        d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
        for d in deps
    }
    return names & set(ALLOWED)


def imported_workspace_packages(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    modules = {p.replace("-", "_"): p for p in ALLOWED}
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in modules and modules[top] != package:
                    found.setdefault(modules[top], set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_declared_dependencies_point_left(package):
    assert declared_workspace_deps(package) <= ALLOWED[package]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_source_imports_point_left(package):
    imports = imported_workspace_packages(package)
    wrong = {dep: files for dep, files in imports.items() if dep not in ALLOWED[package]}
    assert not wrong, f"{package} imports packages to its right: {wrong}"
    undeclared = set(imports) - declared_workspace_deps(package)
    assert not undeclared, f"{package} imports {undeclared} without declaring them"


# -- modules: no import cycle inside a package, and policy/ and generation/ apart -------------


def _in_type_checking(parents: list[ast.AST]) -> bool:
    return any(isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test) for p in parents)


def module_imports() -> dict[str, set[str]]:
    """Every workspace module and the workspace modules it imports.

    Imports inside functions count as much as those at the top of a module: making an import
    lazy only hides a cycle (it works until something needs the other side at import time).
    Imports under ``if TYPE_CHECKING:`` do not count: they never run.
    ``from package import name`` is an edge to the submodule ``package.name`` when there is one,
    else to the package.
    """
    files: dict[str, pathlib.Path] = {}
    for src in ROOT.glob("packages/*/src"):
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    tops = {name.split(".")[0] for name in files}
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        found = edges.setdefault(module, set())
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(ast.parse(path.read_text(), str(path)), [])]
        while stack:
            node, parents = stack.pop()
            stack.extend((child, [*parents, node]) for child in ast.iter_child_nodes(node))
            if not isinstance(node, ast.Import | ast.ImportFrom) or _in_type_checking(parents):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = (
                        module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    )
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, *([node.module] if node.module else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            found.update(t for t in targets if t.split(".")[0] in tops and t != module)
    return edges


def cycles(edges: dict[str, set[str]], modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), among ``modules``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle_between_modules_of_a_package(package):
    """Package ``__init__`` modules are left out, as ``import_check.py`` leaves them out: each
    imports its own submodules to re-export them, so any submodule importing a sibling
    through the package would look like a cycle that Python resolves fine."""
    edges = module_imports()
    top = package.replace("-", "_")
    path_of = {
        m: ROOT / "packages" / package / "src" / (m.replace(".", "/") + ".py") for m in edges
    }
    modules = {m for m in edges if m.split(".")[0] == top and path_of[m].exists()}
    assert modules, f"no modules found for {package}"
    found = cycles(edges, modules)
    assert not found, f"{package} has import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_policy_and_generation_do_not_import_each_other():
    """What both need (the model config and its building, the weight-transfer types and
    channels) lives in ``rl_models.modeling`` and ``rl_models.weight_transfer``."""
    sides = ("rl_models.policy", "rl_models.generation")

    def side(module: str) -> str | None:
        return next((s for s in sides if module == s or module.startswith(s + ".")), None)

    crossing = sorted(
        (module, target)
        for module, targets in module_imports().items()
        for target in targets
        if side(module) and side(target) and side(module) != side(target)
    )
    assert not crossing, "policy/ and generation/ import each other: " + ", ".join(
        f"{a} -> {b}" for a, b in crossing
    )
