"""`pip install rl-distributed` leaves torch out: the cluster tooling works without it, and
BatchedDataDict says how to get it. torch is blocked in a fresh interpreter here; the
`standalone` nox session checks the same on a real install without torch."""

import json
import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None  # `import torch` now fails as if it were not installed

from rl_distributed import (
    NamedSharding, RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup, load_config,
    validate_config,
)
from rl_distributed import cli, cluster_status, launchers, venvs
from rl_distributed._arguments import share_large_values

report = {"sharding": NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]).get_worker_coords(3)}
report["slurm"] = "ray start --head" in launchers.slurm_script(["python", "x.py"], nodes=2)
report["builder"] = RayWorkerBuilder("pkg.mod.Worker").with_python_env("system").python_env
report["small_args_stay_inline"] = share_large_values({"x": [1, 2]}, copies=4) == {"x": [1, 2]}
helps = []
for argv in ([], ["status"], ["venvs"], ["venvs", "build"], ["venvs", "list"],
             ["venvs", "clean"], ["slurm"], ["kuberay"]):
    try:
        cli.main([*argv, "--help"])
    except SystemExit as done:
        helps.append(done.code)
report["helps"] = helps
try:
    from rl_distributed import BatchedDataDict
except ImportError as err:
    report["batched_data_dict_error"] = str(err)
report["torch_loaded"] = any(m == "torch" or m.startswith("torch.") for m in sys.modules
                             if sys.modules[m] is not None)
print(json.dumps(report))
"""


def test_cluster_tooling_works_without_torch_and_batched_data_dict_says_how_to_get_it():
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["sharding"] == {"dp": 1, "tp": 1}
    assert report["slurm"] is True
    assert report["builder"] == "system"
    assert report["small_args_stay_inline"] is True
    assert report["helps"] == [0] * 8
    assert "pip install 'rl-distributed[torch]'" in report["batched_data_dict_error"]
    assert "BatchedDataDict" in report["batched_data_dict_error"]
    assert report["torch_loaded"] is False


def test_torch_is_an_extra_not_a_dependency():
    reqs = [Requirement(r) for r in requires("rl-distributed")]
    torch_reqs = [r for r in reqs if r.name == "torch"]
    assert torch_reqs, "rl-distributed[torch] must bring torch"
    for req in torch_reqs:
        assert req.marker is not None
        assert req.marker.evaluate({"extra": "torch"})
        assert not req.marker.evaluate({"extra": ""})
