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
