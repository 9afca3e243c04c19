"""Build, cache and find the virtualenvs that worker groups run in, with uv.

An environment is built once per node and cached under ``RL_ENV_CACHE_DIR`` (default
``~/.cache/rl/venvs``) in a folder keyed by the environment's name and a hash of what it
contains: the workspace ``uv.lock`` for extras, the *resolution* for requirement lists, the
Python and Ray versions. A changed lock or resolution therefore gives a new folder; an unchanged
one is reused in milliseconds.

Requirement lists are pinned: the driver resolves them once with ``uv pip compile`` (every
package, exact versions), stores the result under ``<cache>/resolutions/`` and reuses it on
later runs; every node builds from that text with ``uv pip sync``, so nodes built on different
days get the same versions. ``resolve(env, upgrade=True)`` (``rl-cluster venvs build
--upgrade``) resolves anew.
Concurrent builders of one environment (several worker groups, several processes on a node)
wait on a file lock, and a folder counts as built only once its marker file is written, so an
interrupted build is redone, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from filelock import FileLock

import rl_distributed
from rl_distributed.venvs.registry import PythonEnv

CACHE_ENV_VAR = "RL_ENV_CACHE_DIR"
WORKSPACE_ENV_VAR = "RL_WORKSPACE_ROOT"
# Every install writes its modules' bytecode: with PYTHONDONTWRITEBYTECODE set, Python would
# never write it, and each worker would compile torch (and vLLM) from source as it starts.
COMPILE = ("--compile-bytecode",)
# How the builder builds; a new format gets new environments (2: with bytecode).
BUILD_FORMAT = 2
#: "1"/"all" rebuilds every environment once per driver; or a comma-separated list of names.
REBUILD_ENV_VAR = "RL_REBUILD_ENVS"
MARKER = ".rl-env.json"
RESOLUTIONS = "resolutions"
OUTPUT_TAIL_LINES = 40


class EnvBuildError(RuntimeError):
    """uv failed to build an environment; the message ends with the tail of uv's output."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "rl" / "venvs")


def workspace_root() -> Path | None:
    """The uv workspace rl-distributed runs from (the folder holding ``uv.lock``), if any."""
    if os.environ.get(WORKSPACE_ENV_VAR):
        return Path(os.environ[WORKSPACE_ENV_VAR]).resolve()
    for parent in Path(rl_distributed.__file__).resolve().parents:
        if (parent / "uv.lock").is_file() and (parent / "pyproject.toml").is_file():
            return parent
    return None


def uv_binary() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise EnvBuildError(
                "uv is needed to build worker environments: pip install uv"
            ) from None
        return found


def _lock_bytes(env: PythonEnv) -> bytes:
    """The workspace lock that pins an environment's extras (empty without extras)."""
    if not env.extras:
        return b""
    root = workspace_root()
    if root is None:
        raise EnvBuildError(
            f"environment {env.name!r} installs workspace extras {list(env.extras)} but no "
            f"uv workspace was found; set {WORKSPACE_ENV_VAR} to the folder with uv.lock"
        )
    return (root / "uv.lock").read_bytes()


def _spec_hash(env: PythonEnv) -> str:
    """What a resolution is resolved from: the spec, and what the resolver must match."""
    spec = {
        "extras": sorted(env.extras),
        "requirements": list(env.requirements),
        "python": sys.version.split()[0],
        "platform": [sys.platform, platform.machine()],
        "ray": ray.__version__,
    }
    digest = hashlib.sha256(_lock_bytes(env))
    digest.update(json.dumps(spec, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def resolution_path(env: PythonEnv) -> Path:
    return cache_root() / RESOLUTIONS / f"{env.name}-{_spec_hash(env)}.txt"


def resolve(env: PythonEnv, upgrade: bool = False) -> str | None:
    """The pinned set of packages for ``env``'s requirements, resolved with uv once.

    The first call resolves (``uv pip compile``) and stores the result; later calls, days later
    too, return the stored text, until ``upgrade`` resolves anew. ``None`` for an environment
    without requirements (extras alone are pinned by ``uv.lock``).
    """
    if not env.requirements:
        return None
    path = resolution_path(env)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file() and not upgrade:
            return path.read_text()
        text = _compile(env)
        # Whole or not at all: a resolve killed mid-write must not leave half a resolution
        # that every later run would reuse (and install) as the pinned set.
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(text)
        os.replace(partial, path)
    return text


def _compile(env: PythonEnv) -> str:
    uv = uv_binary()
    with tempfile.TemporaryDirectory(prefix="rl-resolve-") as tmp:
        wanted = Path(tmp) / "requirements.in"
        pinned = Path(tmp) / "requirements.txt"
        # Workers need the driver's exact Ray next to the user's requirements.
        wanted.write_text("\n".join([f"ray=={ray.__version__}", *env.requirements]) + "\n")
        args = [uv, "pip", "compile", "--quiet", "--no-header", "--python", sys.executable]
        if env.extras:
            # Resolve within what the lock gives the extras, so the requirements add packages
            # but never move a locked one.
            constraints = Path(tmp) / "constraints.txt"
            export = [uv, "export", "--locked", "--no-hashes", "--no-default-groups"]
            export += ["--no-emit-workspace", "--output-file", str(constraints)]
            export += [arg for extra in env.extras for arg in ("--extra", extra)]
            _run(env, export, cwd=workspace_root())
            args += ["--constraint", str(constraints)]
        _run(env, [*args, str(wanted), "--output-file", str(pinned)])
        return pinned.read_text()


def env_key(env: PythonEnv, resolution: str | None = None) -> str:
    """A short hash of everything that decides what the environment contains: the lock for
    extras, the resolution (not the requirement strings) for requirements."""
    if env.requirements and resolution is None:
        resolution = resolve(env)
    digest = hashlib.sha256(_lock_bytes(env))
    spec = {
        "extras": sorted(env.extras),
        "resolution": resolution or "",
        # The environment links (requirements) or installs editable (extras) the source tree it
        # was built from; two checkouts with the same lock must not share one, or workers of
        # one checkout would silently run the other's code.
        "source": str(_source_tree(env)),
        "python": sys.version.split()[0],
        "ray": ray.__version__,
        "build": BUILD_FORMAT,
    }
    digest.update(json.dumps(spec, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _source_tree(env: PythonEnv) -> Path:
    """Where the environment's own code comes from: the workspace for extras, else the
    rl_distributed package that gets linked in."""
    root = workspace_root() if env.extras else None
    return root or Path(rl_distributed.__file__).resolve().parent


def env_dir(env: PythonEnv, resolution: str | None = None) -> Path:
    return cache_root() / f"{env.name}-{env_key(env, resolution)}"


def python_of(folder: Path) -> Path:
    return folder / "bin" / "python"


def ensure_env(env: PythonEnv, rebuild: bool = False, resolution: str | None = None) -> str:
    """Path of the Python executable for ``env`` on this node, building it if needed.

    ``resolution`` is the driver's pinned requirement set (see :func:`resolve`); without one,
    this node resolves (or reuses its stored resolution) itself.
    """
    if env.is_system:
        return sys.executable
    if env.requirements and resolution is None:
        resolution = resolve(env)
    folder = env_dir(env, resolution)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / MARKER).is_file() and not rebuild:
            return str(python_of(folder))
        shutil.rmtree(folder, ignore_errors=True)
        start = time.monotonic()
        try:
            _build(env, folder, resolution)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        info = {
            "name": env.name,
            "extras": list(env.extras),
            "requirements": list(env.requirements),
            "pinned": _pins(resolution),
            "python": sys.version.split()[0],
            "ray": ray.__version__,
            "built_at": time.time(),
            "build_seconds": round(time.monotonic() - start, 2),
        }
        (folder / MARKER).write_text(json.dumps(info, indent=2))
        # One line per build: how operators (and tests) see that the cache was missed.
        with open(cache_root() / "builds.log", "a") as log:
            log.write(json.dumps({"env": folder.name, "pid": os.getpid(), **info}) + "\n")
    return str(python_of(folder))


def _build(env: PythonEnv, folder: Path, resolution: str | None) -> None:
    uv = uv_binary()
    if env.extras:
        # Exactly what the lock says for these extras; no dev tools.
        args = [uv, "sync", "--locked", "--no-default-groups", *COMPILE, "--python", sys.executable]
        args += [arg for extra in env.extras for arg in ("--extra", extra)]
        _run(env, args, cwd=workspace_root(), extra_env={"UV_PROJECT_ENVIRONMENT": str(folder)})
    else:
        _run(env, [uv, "venv", "--quiet", "--python", sys.executable, str(folder)])
    if resolution:
        pinned = folder / "rl-resolution.txt"
        pinned.write_text(resolution)
        python = [*COMPILE, "--python", str(python_of(folder))]
        if env.extras:  # add the pinned requirements to what the lock installed
            _run(env, [uv, "pip", "install", *python, "--no-deps", "-r", str(pinned)])
        else:  # exactly the resolution: nothing more, nothing less
            _run(env, [uv, "pip", "sync", *python, str(pinned)])
    elif not env.extras:
        # Workers need the driver's exact Ray.
        python = str(python_of(folder))
        _run(env, [uv, "pip", "install", *COMPILE, "--python", python, f"ray=={ray.__version__}"])
    if not env.extras:
        # ... and rl_distributed itself (linked, below).
        _link_rl_distributed(folder)


def _pins(resolution: str | None) -> list[str]:
    """The ``name==version`` lines of a resolution."""
    if not resolution:
        return []
    return [
        line.split(";")[0].strip()
        for line in resolution.splitlines()
        if line.strip() and not line.lstrip().startswith("#") and "==" in line
    ]


def _link_rl_distributed(folder: Path) -> None:
    """Make this process's rl_distributed importable there without its dependencies.

    The worker host needs only Ray and the standard library; linking (not installing) keeps the
    environment free of everything else the driver has, so user pins cannot clash with ours.
    """
    links = folder / "rl-links"
    links.mkdir(exist_ok=True)
    (links / "rl_distributed").symlink_to(Path(rl_distributed.__file__).resolve().parent)
    (site_packages,) = (folder / "lib").glob("python3*/site-packages")
    (site_packages / "_rl_links.pth").write_text(str(links) + "\n")


def _run(env: PythonEnv, args: list[str], cwd: Path | None = None, extra_env=None) -> None:
    environ = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")
    }
    environ.update(extra_env or {})
    done = subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip().splitlines()
        tail = "\n".join(output[-OUTPUT_TAIL_LINES:])
        raise EnvBuildError(
            f"building Python environment {env.name!r} failed: `{' '.join(args[1:4])} …` "
            f"exited with {done.returncode}. Last lines of uv's output:\n{tail}"
        )


def rebuild_requested(env: PythonEnv) -> bool:
    wanted = os.environ.get(REBUILD_ENV_VAR, "").strip()
    if wanted.lower() in ("1", "all", "true", "yes"):
        return True
    return env.name in {name.strip() for name in wanted.split(",") if name.strip()}


def list_envs() -> list[dict]:
    """The environments cached on this node, with what built them and their size."""
    found = []
    for marker in sorted(cache_root().glob(f"*/{MARKER}")):
        info = json.loads(marker.read_text())
        size = sum(
            f.lstat().st_size
            for f in marker.parent.rglob("*")
            if f.is_file() and not f.is_symlink()
        )
        found.append({**info, "path": str(marker.parent), "size_bytes": size})
    return found


def clean_envs(name: str | None = None) -> list[str]:
    """Delete cached environments (all, or those named ``name``); returns the folders removed.

    Stored resolutions stay: a rebuilt environment gets the same versions again."""
    removed = []
    root = cache_root()
    if not root.is_dir():
        return removed
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != RESOLUTIONS):
        env_name = folder.name.rsplit("-", 1)[0]
        if name is None or env_name == name:
            with FileLock(str(folder) + ".lock"):
                shutil.rmtree(folder, ignore_errors=True)
            Path(str(folder) + ".lock").unlink(missing_ok=True)
            removed.append(str(folder))
    return removed
