"""Test sessions. `nox -s tests` is what CI runs; `nox -l` lists the sessions.

Each package session syncs only that package and its own dependencies (from the one uv.lock)
into a fresh environment and runs its tests there: that is what proves a package installs and
works alone. `slow` holds the long tier (multi-process Ray clusters started by the tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

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
SANDBOX_TESTS = [  # run again unprivileged: the tests and the one module they import
    "packages/rl-envs/tests/sandbox_helpers.py",
    "packages/rl-envs/tests/test_sandbox.py",
    "packages/rl-envs/tests/test_sandbox_containment.py",
]
SANDBOX_TEST_USER = "rl-sandbox-ci"
# What the sandbox tests import, installed at the session's (the lock's) versions.
SANDBOX_TEST_DEPS = [
    "pydantic", "pydantic-core", "annotated-types", "typing-extensions", "typing-inspection",
    "hydra-core", "omegaconf", "antlr4-python3-runtime", "pyyaml", "packaging", "attrs",
    "pytest", "pluggy", "iniconfig", "pygments", "pytest-timeout",
]  # fmt: skip


def sync(session: nox.Session, *args: str) -> None:
    """Install exactly what the lock gives for `args` into this session's environment, with
    its modules' bytecode: where PYTHONDONTWRITEBYTECODE is set (as on this project's test
    machines) Python never writes it, and every test process and Ray worker would compile
    torch, transformers and vLLM from source as it starts (vLLM's imports: 25 s instead of
    11 s on a 2-core machine)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--compile-bytecode",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def pytest(
    session: nox.Session, *paths: str, marks: str = "not slow", options: tuple[str, ...] = ()
) -> None:
    session.run("python", "-m", "pytest", *paths, "-m", marks, *options, *session.posargs)


for _package in PACKAGES:

    @nox.session(name=_package, python=PYTHON)
    def package_session(session: nox.Session, package: str = _package) -> None:
        sync(session, "--package", package, "--group", "test")
        # The slowest tests' times are printed, as the slow tier's: where CI's time goes.
        pytest(session, f"packages/{package}/tests", options=("--durations=10",))
        if package == "rl-envs":
            sandbox_tests_unprivileged(session)


def sandbox_tests_unprivileged(session: nox.Session) -> None:
    """Run the sandbox tests again as an unprivileged user when CI runs as root.

    As root, bubblewrap is started as `nobody`; as any other user it goes through unprivileged
    user namespaces, the way most users run it: both must hold. The session's interpreter may
    live under /root, which the user cannot enter, so the tests get a venv on the system
    Python, with the few packages they import at the lock's versions, in a world-readable
    temporary directory.
    """
    if os.geteuid() != 0:
        return  # the session above already ran them unprivileged
    if subprocess.run(["id", "-u", SANDBOX_TEST_USER], capture_output=True).returncode != 0:
        session.run(
            *("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"),
            SANDBOX_TEST_USER,
            external=True,
        )
    work = tempfile.mkdtemp(prefix="rl-sandbox-tests-")
    try:
        versions = session.run(
            "python",
            "-c",
            f"import importlib.metadata as m\nfor n in {SANDBOX_TEST_DEPS!r}: "
            "print(f'{n}=={m.version(n)}')",
            silent=True,
        )
        with open(f"{work}/requirements.txt", "w") as f:
            f.write(versions)
        venv = f"{work}/venv"
        session.run("uv", "venv", "-q", "--python", "/usr/bin/python3", venv, external=True)
        install = ("uv", "pip", "install", "-q", "--python", venv)
        session.run(*install, "-r", f"{work}/requirements.txt", external=True)
        session.run(
            *install, "--no-deps", "./packages/rl-envs", "./packages/rl-distributed", external=True
        )
        os.makedirs(f"{work}/tests")
        for path in SANDBOX_TESTS:
            shutil.copy(path, f"{work}/tests/")
        session.run("chmod", "-R", "a+rX", work, external=True)
        with session.chdir(work):
            session.run(
                *("runuser", "-u", SANDBOX_TEST_USER, "--"),
                *(f"{venv}/bin/python", "-m", "pytest", "-p", "no:cacheprovider"),
                *("--import-mode=importlib", "tests", *session.posargs),  # as pyproject.toml's
                external=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Cross-package tests (tests/, the docs' code blocks among them) in the full workspace
    environment, then the docs site, built as the `docs` session builds it."""
    sync(session)
    pytest(session, "tests", options=("--durations=10",))
    build_docs(session)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The docs site, warnings as errors; the config reference is generated from the configs."""
    sync(session)
    build_docs(session)


def build_docs(session: nox.Session) -> None:
    with tempfile.TemporaryDirectory(prefix="rl-docs-site-") as site:
        session.run(
            *("mkdocs", "build", "--strict", "--site-dir", site),
            env={"NO_MKDOCS_2_WARNING": "1"},
        )


@nox.session(python=PYTHON)
def slow(session: nox.Session) -> None:
    """The slow tier of every package, in the full workspace environment."""
    sync(session)
    # The slowest tests' times are printed: this tier is what fills CI's time budget.
    paths = ("tests", *(f"packages/{p}/tests" for p in PACKAGES))
    pytest(session, *paths, marks="slow", options=("--durations=25",))


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
    """Everything CI runs: lint, each package alone, integration (with the docs build),
    standalone install, slow."""
    for name in ["lint", *PACKAGES, "integration", "standalone", "slow"]:
        session.notify(name)
