"""bench/gpu_check.py runs where only torch, transformers and its small carried wheels exist.

The GPU machines have neither Ray nor vLLM nor our packages installed (their sources go on
PYTHONPATH, so package metadata is missing too). Both tests make a fresh interpreter look like
that: ``ray`` and ``vllm`` import as not installed (``sys.modules[name] = None``) and
``importlib.metadata`` knows no ``rl-*`` distribution.
"""

from __future__ import annotations

import ast
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
module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
ours = ("rl_distributed", "rl_data", "rl_models", "mfu", "gpu_check", "gpu_check_parallel")
loaded = {{m: getattr(mod, "__file__", None) for m, mod in sys.modules.items() if mod is not None}}
print(json.dumps({{
    "ray_or_vllm": sorted(m for m in loaded if m.split(".")[0] in ("ray", "vllm")),
    "ours": {{m: f for m, f in loaded.items() if m.split(".")[0] in ours and f}},
}}))
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


def module_level_imports(path: str) -> set[str]:
    """The top-level names a module imports when it is imported (not inside functions)."""
    tree = ast.parse(Path(path).read_text())
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return names


def test_gpu_check_imports_nothing_but_torch_transformers_and_the_carry():
    """What gpu_check's modules and ours on its path import when loaded, and what those need in
    turn (their declared requirements), is on the GPU machine (torch, transformers and their
    requirements) or in the carry. (Optional packages that transformers uses only when they
    happen to be installed are not needed: the check ran in a venv without them.)"""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_GPU_CHECK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ray_or_vllm"] == []
    assert "rl_models.policy.dtensor_worker" in report["ours"]
    assert "rl_models.generation.hf_worker" in report["ours"]
    assert "gpu_check_parallel" in report["ours"]
    ours = {"rl_distributed", "rl_data", "rl_models", "mfu", "gpu_check", "gpu_check_parallel"}
    imported = set().union(*(module_level_imports(f) for f in report["ours"].values()))
    third_party = imported - ours - set(sys.stdlib_module_names) - {"__future__"}
    dists = packages_distributions()
    needed = {canonicalize_name(d) for module in third_party for d in dists.get(module, [module])}
    on_the_machine = with_dependencies(["torch", "transformers"])
    available = on_the_machine | carried()
    assert needed - available == set(), "imported, but neither on the GPU machine nor carried"
    assert {"pydantic", "omegaconf", "hydra-core"} <= needed  # (the scan sees our imports)
    assert with_dependencies(sorted(carried())) - available == set(), "the carry needs more"


@pytest.mark.slow  # five processes that import torch and transformers: ~1 min on 2 cores
@pytest.mark.timeout(900)  # roomy: a loaded 2-core machine made it many times slower
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
        timeout=840,
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
        # bench/gpu_check_parallel.py: context parallel at both worlds (cp=1: the packed row
        # unsplit), tensor parallel at world 2 only (tp=1 would be the rows check above).
        "world 1 (cpu, none (one process)), cp=1, one packed row: the training step's forward",
        "world 1 (cpu, none (one process)), cp=1, one packed row: chunked log-probs",
        "world 1 (cpu, none (one process)), cp=1, one packed row: bf16 training step vs float64",
        "world 2 (cpu, gloo), tp=2, sequence parallel: chunked log-probs",
        "world 2 (cpu, gloo), tp=2, sequence parallel: bf16 training step vs float64",
        "world 2 (cpu, gloo), cp=2, one packed row: the training step's forward",
        "world 2 (cpu, gloo), cp=2, one packed row: chunked log-probs",
        "world 2 (cpu, gloo), cp=2, one packed row: bf16 training step vs float64",
    ]:
        assert sum(c.startswith(f"PASS {expected}") for c in checks) == 1, expected
    # Every rank of a tensor- or context-parallel case computes the whole batch's log-probs,
    # so each one's are checked; every step is checked tensor by tensor.
    for case in ("tp=2, sequence parallel", "cp=2, one packed row"):
        (line,) = [c for c in checks if f"{case}: chunked log-probs" in c]
        assert "rank 0: max" in line and "rank 1: max" in line, line
    assert all("tensor by tensor: worst" in c for c in checks if "training step vs" in c)
    assert "CPU stand-in for CUDA IPC" in out
    # MFU comes last: the summary, then the MFU lines.
    tail = out.strip().splitlines()
    assert tail[-1].strip().startswith("training / measured matmul peak:")
    assert "23 checks passed, 0 failed" in out
