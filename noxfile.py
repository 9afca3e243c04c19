"""Test sessions. `nox -s tests` is what CI runs; `nox -l` lists the sessions.

Each package session syncs only that package and its own dependencies (from the one uv.lock)
into a fresh environment and runs its tests there: that is what proves a package installs and
works alone. `slow` holds the long tier (multi-process Ray clusters started by the tests).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests"]

PYTHON = "3.11"
PACKAGES = ["rl-distributed", "rl-data", "rl-envs", "rl-models", "rl-algorithms"]
NOT_IN_STANDALONE_DISTRIBUTED = [
    "torch",
    "transformers",
    "vllm",
    "megatron",
    "rl_data",
    "rl_models",
]


def sync(session: nox.Session, *args: str) -> None:
    """Install exactly what the lock gives for `args` into this session's environment."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def pytest(session: nox.Session, *paths: str, marks: str = "not slow") -> None:
    session.run("python", "-m", "pytest", *paths, "-m", marks, *session.posargs)


for _package in PACKAGES:

    @nox.session(name=_package, python=PYTHON)
    def package_session(session: nox.Session, package: str = _package) -> None:
        sync(session, "--package", package, "--group", "test")
        pytest(session, f"packages/{package}/tests")


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Cross-package tests (tests/) in the full workspace environment."""
    sync(session)
    pytest(session, "tests")


@nox.session(python=PYTHON)
def slow(session: nox.Session) -> None:
    """The slow tier of every package, in the full workspace environment."""
    sync(session)
    pytest(session, "tests", *(f"packages/{p}/tests" for p in PACKAGES), marks="slow")


WITHOUT_TORCH = f"""
import importlib.util, sys
leaked = [m for m in {NOT_IN_STANDALONE_DISTRIBUTED!r} if importlib.util.find_spec(m)]
if leaked:
    sys.exit(f"installed with rl-distributed but must not be: {{leaked}}")
from rl_distributed import NamedSharding, RayVirtualCluster, RayWorkerGroup, load_config
from rl_distributed import venvs
try:
    from rl_distributed import BatchedDataDict
except ImportError as err:
    if "pip install 'rl-distributed[torch]'" not in str(err):
        sys.exit(f"BatchedDataDict without torch must say how to install it, said: {{err}}")
else:
    sys.exit("BatchedDataDict imported without torch installed")
"""
WITH_TORCH = """
import torch
from rl_distributed import BatchedDataDict
shards = BatchedDataDict(x=torch.arange(6)).shard_by_batch_size(2)
assert [s["x"].tolist() for s in shards] == [[0, 1, 2], [3, 4, 5]], shards
"""


@nox.session(python=PYTHON, venv_backend="venv")
def standalone(session: nox.Session) -> None:
    """`pip install ./packages/rl-distributed` alone, with plain pip: the cluster tooling works
    and torch is absent; with the `torch` extra, BatchedDataDict works too."""
    session.install("./packages/rl-distributed")
    session.run("python", "-c", WITHOUT_TORCH)
    # The cluster tooling comes with it: every subcommand answers --help.
    for command in (
        [],
        ["status"],
        ["venvs"],
        ["venvs", "build"],
        ["venvs", "list"],
        ["venvs", "clean"],
        ["slurm"],
        ["kuberay"],
    ):
        session.run("rl-cluster", *command, "--help", silent=True)
    # On CPU machines torch comes from the local CPU wheel (pip.conf find-links); a bare
    # range would let pip pick the newest CUDA build from PyPI.
    session.install("torch==2.13.0")
    session.install("./packages/rl-distributed[torch]")
    session.run("python", "-c", WITH_TORCH)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """Everything CI runs: lint, each package alone, integration, standalone install, slow."""
    for name in ["lint", *PACKAGES, "integration", "standalone", "slow"]:
        session.notify(name)
