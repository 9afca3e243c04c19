"""Build, cache and find the virtualenvs that worker groups run in, with uv.

An environment is built once per node and cached under ``RL_ENV_CACHE_DIR`` (default
``~/.cache/rl/venvs``) in a folder keyed by the environment's name and a hash of what defines
it: the workspace ``uv.lock``, the extras and requirements, the Python and Ray versions. A
changed lock therefore gives a new folder; an unchanged one is reused in milliseconds.
Concurrent builders of one environment (several worker groups, several processes on a node)
wait on a file lock, and a folder counts as built only once its marker file is written, so an
interrupted build is redone, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ray
from filelock import FileLock

import rl_distributed
from rl_distributed.venvs.registry import PythonEnv

CACHE_ENV_VAR = "RL_ENV_CACHE_DIR"
WORKSPACE_ENV_VAR = "RL_WORKSPACE_ROOT"
#: "1"/"all" rebuilds every environment once per driver; or a comma-separated list of names.
REBUILD_ENV_VAR = "RL_REBUILD_ENVS"
MARKER = ".rl-env.json"
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


def env_key(env: PythonEnv) -> str:
    """A short hash of everything that decides what the environment contains."""
    digest = hashlib.sha256()
    root = workspace_root()
    if env.extras:
        if root is None:
            raise EnvBuildError(
                f"environment {env.name!r} installs workspace extras {list(env.extras)} but no "
                f"uv workspace was found; set {WORKSPACE_ENV_VAR} to the folder with uv.lock"
            )
        digest.update((root / "uv.lock").read_bytes())
    spec = {
        "extras": sorted(env.extras),
        "requirements": list(env.requirements),
        "python": sys.version.split()[0],
        "ray": ray.__version__,
    }
    digest.update(json.dumps(spec, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def env_dir(env: PythonEnv) -> Path:
    return cache_root() / f"{env.name}-{env_key(env)}"


def python_of(folder: Path) -> Path:
    return folder / "bin" / "python"


def ensure_env(env: PythonEnv, rebuild: bool = False) -> str:
    """Path of the Python executable for ``env`` on this node, building it if needed."""
    if env.is_system:
        return sys.executable
    folder = env_dir(env)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / MARKER).is_file() and not rebuild:
            return str(python_of(folder))
        shutil.rmtree(folder, ignore_errors=True)
        start = time.monotonic()
        try:
            _build(env, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        info = {
            "name": env.name,
            "extras": list(env.extras),
            "requirements": list(env.requirements),
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


def _build(env: PythonEnv, folder: Path) -> None:
    uv = uv_binary()
    if env.extras:
        # Exactly what the lock says for these extras; no dev tools.
        args = [uv, "sync", "--locked", "--no-default-groups", "--python", sys.executable]
        args += [arg for extra in env.extras for arg in ("--extra", extra)]
        _run(env, args, cwd=workspace_root(), extra_env={"UV_PROJECT_ENVIRONMENT": str(folder)})
    else:
        _run(env, [uv, "venv", "--quiet", "--python", sys.executable, str(folder)])
        # Workers need the driver's exact Ray, plus rl_distributed itself (linked, below).
        _run(
            env,
            [
                uv,
                "pip",
                "install",
                "--python",
                str(python_of(folder)),
                f"ray=={ray.__version__}",
                *env.requirements,
            ],
        )
        _link_rl_distributed(folder)
    if env.extras and env.requirements:
        _run(env, [uv, "pip", "install", "--python", str(python_of(folder)), *env.requirements])


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
    """Delete cached environments (all, or those named ``name``); returns the folders removed."""
    removed = []
    root = cache_root()
    if not root.is_dir():
        return removed
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        env_name = folder.name.rsplit("-", 1)[0]
        if name is None or env_name == name:
            with FileLock(str(folder) + ".lock"):
                shutil.rmtree(folder, ignore_errors=True)
            Path(str(folder) + ".lock").unlink(missing_ok=True)
            removed.append(str(folder))
    return removed
