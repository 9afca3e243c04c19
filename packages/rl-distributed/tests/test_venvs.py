"""Registry and uv builder of isolated worker environments (no Ray needed)."""

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import ray

from rl_distributed.venvs import builder
from rl_distributed.venvs.builder import (
    EnvBuildError,
    clean_envs,
    ensure_env,
    env_dir,
    list_envs,
    resolve,
)
from rl_distributed.venvs.registry import EnvRegistry, PythonEnv, UnknownEnvError

SIX_OLD = PythonEnv("six-old", requirements=("six==1.16.0",))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_ENV_CACHE_DIR", str(tmp_path / "envs"))
    return tmp_path / "envs"


def builds(cache) -> list[dict]:
    log = cache / "builds.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_registry_picks_exact_then_longest_module_prefix(monkeypatch):
    reg = EnvRegistry()
    reg.define(PythonEnv("judge", requirements=("sympy",)))
    reg.register("pkg.gen", "vllm")
    reg.register("pkg.gen.special", "judge")
    reg.register("pkg.gen.vllm_worker.Worker", "mcore")
    assert reg.env_for("pkg.gen.vllm_worker.Worker").name == "mcore"
    assert reg.env_for("pkg.gen.vllm_worker.Other").name == "vllm"
    assert reg.env_for("pkg.gen.special.deep.Worker").name == "judge"
    assert reg.env_for("elsewhere.Worker").name == "system"
    monkeypatch.setenv("RL_UNREGISTERED_WORKER_ENV", "error")
    with pytest.raises(UnknownEnvError, match=r"'elsewhere\.Worker' is not registered"):
        reg.env_for("elsewhere.Worker")
    with pytest.raises(UnknownEnvError, match=r"no Python environment named 'nope'.*'judge'"):
        reg.register("x.Y", "nope")


def test_env_definitions_are_validated():
    with pytest.raises(ValueError, match="takes no spec"):
        PythonEnv("system", requirements=("six",))
    with pytest.raises(ValueError, match="plain, non-empty name"):
        PythonEnv("../escape")


def test_cache_key_follows_what_defines_the_env(cache, tmp_path, monkeypatch):
    assert env_dir(SIX_OLD) == env_dir(PythonEnv("six-old", requirements=("six==1.16.0",)))
    assert env_dir(SIX_OLD) != env_dir(PythonEnv("six-old", requirements=("six==1.17.0",)))
    # Extras are keyed by the workspace lock file: a new lock means a new environment.
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "pyproject.toml").write_text("[project]\nname='x'\n")
    (tmp_path / "ws" / "uv.lock").write_text("version = 1\n")
    monkeypatch.setenv("RL_WORKSPACE_ROOT", str(tmp_path / "ws"))
    before = env_dir(PythonEnv("vllm", extras=("vllm",)))
    (tmp_path / "ws" / "uv.lock").write_text("version = 1\n# changed\n")
    assert env_dir(PythonEnv("vllm", extras=("vllm",))) != before
    assert before.parent == cache


def test_two_checkouts_with_the_same_lock_do_not_share_an_environment(cache, tmp_path, monkeypatch):
    # Extras install the workspace's packages editable: another checkout's environment would
    # run the other checkout's code.
    dirs = []
    for name in ("checkout-a", "checkout-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pyproject.toml").write_text("[project]\nname='x'\n")
        (tmp_path / name / "uv.lock").write_text("version = 1\n")
        monkeypatch.setenv("RL_WORKSPACE_ROOT", str(tmp_path / name))
        dirs.append(env_dir(PythonEnv("mcore", extras=("mcore",))))
    assert dirs[0] != dirs[1]


def test_build_once_reuse_and_rebuild(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # away from the workspace's uv settings: the builder's own hold
    python = ensure_env(SIX_OLD)
    # Installed with its bytecode (looked for before anything there imported and wrote it): a
    # worker never compiles its packages from source, as it would on every start where
    # PYTHONDONTWRITEBYTECODE is set.
    site = Path(python).parent.parent / "lib"
    for module in ("__pycache__/six", "ray/__pycache__/__init__"):
        assert list(site.glob(f"python*/site-packages/{module}.cpython-*.pyc")), module
    out = subprocess.run(
        [python, "-c", "import six, ray, rl_distributed.worker_host; print(six.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "1.16.0"
    assert ensure_env(SIX_OLD) == python
    assert len(builds(cache)) == 1
    ensure_env(SIX_OLD, rebuild=True)
    assert len(builds(cache)) == 2
    [listed] = list_envs()
    assert listed["name"] == "six-old" and listed["requirements"] == ["six==1.16.0"]
    assert clean_envs("six-old") == [listed["path"]]
    assert list_envs() == []


def test_the_isolated_env_does_not_see_the_drivers_packages(cache):
    python = ensure_env(PythonEnv("bare"))
    # The driver has pydantic and torch; the worker environment has only Ray and its deps.
    out = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr


def test_concurrent_builders_wait_on_the_lock_and_build_once(cache):
    code = (
        "from rl_distributed.venvs.builder import ensure_env;"
        "from rl_distributed.venvs.registry import PythonEnv;"
        "print(ensure_env(PythonEnv('six-old', requirements=('six==1.16.0',))))"
    )
    env = {**os.environ, "RL_ENV_CACHE_DIR": str(cache)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    assert len(builds(cache)) == 1


def test_a_failed_build_raises_with_uvs_output_and_leaves_nothing(cache):
    bad = PythonEnv("broken", requirements=("rl-no-such-package-anywhere==9.9.9",))
    with pytest.raises(EnvBuildError, match=r"(?s)'broken' failed.*rl-no-such-package-anywhere"):
        ensure_env(bad)
    # Neither a half-built environment nor a resolution is left behind.
    assert list(cache.glob("broken-*")) == []
    assert list(cache.glob("resolutions/broken-*.txt")) == []
    assert builds(cache) == []


def test_rebuild_requests_from_the_environment(monkeypatch):
    monkeypatch.setenv("RL_REBUILD_ENVS", "vllm, judge")
    assert builder.rebuild_requested(PythonEnv("judge"))
    assert not builder.rebuild_requested(PythonEnv("other"))
    monkeypatch.setenv("RL_REBUILD_ENVS", "1")
    assert builder.rebuild_requested(PythonEnv("other"))


def make_wheel(folder: Path, version: str) -> None:
    """A tiny pure-Python wheel of `rl-pin-probe` (a name on no index) at ``version``."""
    dist = f"rl_pin_probe-{version}"
    files = {
        "rl_pin_probe/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: rl-pin-probe\nVersion: {version}\n"
        ),
        f"{dist}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: rl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def probe_version(python: str) -> str:
    code = "import rl_pin_probe; print(rl_pin_probe.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout


def test_requirements_are_resolved_once_and_every_node_builds_the_same_versions(
    tmp_path, monkeypatch
):
    """A loose requirement, and a new release between two nodes' builds: both nodes get the
    version the driver resolved; only an explicit upgrade moves it."""
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "1.0")
    monkeypatch.setenv("UV_FIND_LINKS", str(index))
    driver, node_a, node_b = (tmp_path / n for n in ("driver", "node-a", "node-b"))
    env = PythonEnv("pinned", requirements=("rl-pin-probe>=1.0",))

    monkeypatch.setenv("RL_ENV_CACHE_DIR", str(driver))
    resolution = resolve(env)
    assert "rl-pin-probe==1.0" in resolution
    assert f"ray=={ray.__version__}" in resolution

    monkeypatch.setenv("RL_ENV_CACHE_DIR", str(node_a))
    python_a = ensure_env(env, resolution=resolution)
    assert probe_version(python_a).strip() == "1.0"

    make_wheel(index, "1.1")  # released after the first node was built

    monkeypatch.setenv("RL_ENV_CACHE_DIR", str(node_b))
    python_b = ensure_env(env, resolution=resolution)
    assert probe_version(python_b).strip() == "1.0"
    # Same resolution, same cache key on every node.
    assert Path(python_a).parent.parent.name == Path(python_b).parent.parent.name
    [built] = list_envs()
    assert "rl-pin-probe==1.0" in built["pinned"]

    # The driver keeps its stored resolution on later runs; an upgrade resolves anew, and
    # the new resolution is a new environment.
    monkeypatch.setenv("RL_ENV_CACHE_DIR", str(driver))
    assert resolve(env) == resolution
    upgraded = resolve(env, upgrade=True)
    assert "rl-pin-probe==1.1" in upgraded
    assert env_dir(env, upgraded).name != env_dir(env, resolution).name
    assert resolve(env) == upgraded


def test_a_resolve_killed_while_storing_leaves_no_half_resolution(cache, monkeypatch):
    """The stored resolution is reused on every later run, so it must be whole or absent."""
    full = "ray==2.0.0\nsix==1.16.0\n"
    monkeypatch.setattr(builder, "_compile", lambda env: full)
    real_write_text = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt  # the driver is stopped in the middle of writing

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve(SIX_OLD)
    monkeypatch.setattr(Path, "write_text", real_write_text)
    assert resolve(SIX_OLD) == full
    assert builder.resolution_path(SIX_OLD).read_text() == full
