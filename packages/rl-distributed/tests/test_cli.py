"""The rl-cluster command: help, launch files, environments, status."""

import os
import subprocess
import sys

import pytest
import yaml

from rl_distributed.cli import main
from rl_distributed.launchers import CHECKPOINT_DEADLINE_ENV, kuberay_manifest, slurm_script


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["status"],
        ["venvs"],
        ["venvs", "build"],
        ["venvs", "list"],
        ["venvs", "clean"],
        ["slurm"],
        ["kuberay"],
    ],
)
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    assert "usage: rl-cluster" in capsys.readouterr().out


def test_slurm_script_starts_a_head_then_workers_then_the_job(tmp_path, capsys):
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "4",
                "--gpus-per-node",
                "2",
                "--sbatch=--account=abc",
                "--",
                "uv",
                "run",
                "python",
                "train.py",
                "lr=1e-5 x",
            ]
        )
        == 0
    )
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=4" in script and "#SBATCH --account=abc" in script
    assert script.index("ray start --head") < script.index('ray start --address="$RAY_ADDRESS"')
    assert script.rstrip().endswith("uv run python train.py 'lr=1e-5 x'")
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # valid bash
    with pytest.raises(ValueError, match="the command to run"):
        slurm_script([], nodes=2)


@pytest.mark.parametrize(
    ("squeue_answer", "exported"),
    [
        ("echo 2030-03-01T12:00:00", str(1898596800 - 7 * 60)),  # the job's end less the margin
        ("echo Unlimited", "unset"),  # a job without a time limit: no deadline
        ("exit 1", "unset"),  # squeue failed: not today's midnight (what `date -d ""` gives)
        ("echo 2020-03-01T12:00:00", "unset"),  # a deadline already past is not exported
    ],
)
def test_slurm_script_exports_the_jobs_end_less_the_margin(tmp_path, squeue_answer, exported):
    """The script's deadline lines, with `squeue` answering as Slurm does (%e: the end time)."""
    script = slurm_script(["true"], nodes=1, time="01:00:00", save_margin_minutes=7)
    deadline_lines = script[script.index("end_time=") : script.index("\nnodes=")]
    (tmp_path / "squeue").write_text(f"#!/bin/sh\n{squeue_answer}\n")
    (tmp_path / "squeue").chmod(0o755)
    out = subprocess.run(
        [
            "bash",
            "-c",
            f"set -euo pipefail\n{deadline_lines}\necho ${{{CHECKPOINT_DEADLINE_ENV}:-unset}}",
        ],
        env={
            **os.environ,
            "PATH": f"{tmp_path}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "7",
            "TZ": "UTC",
        },
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == exported
    with pytest.raises(ValueError, match="save_margin_minutes"):
        slurm_script(["true"], nodes=1, save_margin_minutes=-1)


def test_kuberay_manifest_is_a_valid_raycluster():
    manifest = yaml.safe_load(kuberay_manifest(["python", "train.py"], workers=3, image="img:1"))
    assert manifest["kind"] == "RayCluster"
    [group] = manifest["spec"]["workerGroupSpecs"]
    assert group["replicas"] == 3
    assert group["template"]["spec"]["containers"][0]["image"] == "img:1"


def test_venvs_build_list_clean(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RL_ENV_CACHE_DIR", str(tmp_path))
    assert main(["venvs", "build", "tiny", "-r", "six==1.16.0"]) == 0
    python = capsys.readouterr().out.split(": ", 1)[1].strip()
    assert python.startswith(str(tmp_path))
    assert main(["venvs", "list"]) == 0
    assert "six==1.16.0" in capsys.readouterr().out
    assert main(["venvs", "build", "undefined-env"]) == 1
    assert "no Python environment named 'undefined-env'" in capsys.readouterr().err
    assert main(["venvs", "clean"]) == 0
    assert "removed" in capsys.readouterr().out


@pytest.mark.ray
def test_status_shows_nodes_and_placement_groups(ray_session):
    import ray

    from rl_distributed import RayVirtualCluster

    cluster = RayVirtualCluster([2], use_gpus=False, name="status-probe")
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rl_distributed.cli",
                "status",
                "--address",
                ray.get_runtime_context().gcs_address,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        cluster.shutdown()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nodes" in out.stdout and "alive" in out.stdout
    assert "status-probe-node0" in out.stdout and "CREATED" in out.stdout
    assert "object store" in out.stdout
