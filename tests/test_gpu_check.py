"""bench/gpu_check.py runs where only torch, transformers and its small carried wheels exist.

The GPU machines have neither Ray nor vLLM nor our packages installed (their sources go on
PYTHONPATH, so package metadata is missing too). Both tests make a fresh interpreter look like
that: ``ray`` and ``vllm`` import as not installed (``sys.modules[name] = None``) and
``importlib.metadata`` knows no ``rl-*`` distribution.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# Run first in every interpreter (as sitecustomize.py on PYTHONPATH, or inline).
LIKE_THE_GPU_MACHINE = """
import importlib.metadata as _metadata, sys
sys.modules["ray"] = None
sys.modules["vllm"] = None
_version = _metadata.version
def _no_rl_metadata(name):
    if name.replace("_", "-").startswith("rl-"):
        raise _metadata.PackageNotFoundError(name)
    return _version(name)
_metadata.version = _no_rl_metadata
"""

IMPORT_GPU_CHECK = f"""{LIKE_THE_GPU_MACHINE}
import importlib.util, json
sys.path.insert(0, {str(BENCH)!r})
spec = importlib.util.spec_from_file_location("gpu_check", {str(BENCH / "gpu_check.py")!r})
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(json.dumps(sorted({{m.split(".")[0] for m, mod in sys.modules.items() if mod is not None}})))
"""


def carried() -> set[str]:
    """The distributions bench/gpu_check_carry.sh carries to the GPU machine."""
    script = (BENCH / "gpu_check_carry.sh").read_text()
    block = re.search(r"CARRY=\((.*?)\)", script, flags=re.S)
    assert block, "gpu_check_carry.sh has no CARRY=(...) list"
    return {canonicalize_name(n) for n in block.group(1).split()}


def with_dependencies(names: list[str]) -> set[str]:
    """``names`` and everything they require (no extras), as installed here."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        for req in map(Requirement, reqs):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_gpu_check_imports_nothing_but_torch_transformers_and_the_carry():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_GPU_CHECK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ray" not in modules and "vllm" not in modules
    ours = {"rl_distributed", "rl_data", "rl_models", "mfu", "gpu_check"}
    on_the_machine = with_dependencies(["torch", "transformers"])
    dists = packages_distributions()
    missing = {
        module: dists.get(module)
        for module in modules
        if module not in sys.stdlib_module_names and module not in ours and module != "__main__"
        if not {canonicalize_name(d) for d in dists.get(module, [])} & (on_the_machine | carried())
    }
    assert not missing, f"imported, but neither on the GPU machine nor carried: {missing}"


@pytest.mark.slow  # five processes that import torch and transformers: ~1 min on 2 cores
def test_gpu_check_passes_on_the_cpu_without_ray(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(LIKE_THE_GPU_MACHINE)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path)}
    args = ["--model", "micro", "--new-tokens", "4"]
    args += ["--mfu-sequences", "4", "--mfu-longest", "32", "--mfu-steps", "1"]
    args += ["--mfu-matmul-size", "128"]
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    checks = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert not [c for c in checks if c.startswith("FAIL")]
    for expected in [
        "world 1 (cpu, none (one process)): chunked log-probs",
        "world 1 (cpu, none (one process)): bf16 training step vs float64",
        "world 1: weights from policy rank 0 (cpu) to the generation worker",
        "generation on cpu: greedy token ids and lengths",
        "generation on cpu: greedy tokens = argmax of the float64 logits",
        "generation on cpu: greedy log-probs (float32) vs float64",
        "generation on cpu: sampled token ids and lengths",
        "generation on cpu: sampled log-probs (float32) vs float64",
        "world 1: weights over the shared-memory region channel (CPU)",
        "world 2 (cpu, gloo): chunked log-probs",
        "world 2 (cpu, gloo): bf16 training step vs float64",
        "world 2: weights from policy rank 0 (cpu) to the generation worker",
        "world 2: weights over the shared-memory region channel (CPU)",
        "world 1: every rank exited cleanly",
        "world 2: every rank exited cleanly",
    ]:
        assert sum(c.startswith(f"PASS {expected}") for c in checks) == 1, expected
    assert "CPU stand-in for CUDA IPC" in out
    # MFU comes last: the summary, then the MFU lines.
    tail = out.strip().splitlines()
    assert tail[-1].strip().startswith("training / measured matmul peak:")
    assert "15 checks passed, 0 failed" in out
