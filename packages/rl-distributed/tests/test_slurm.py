"""`rl-cluster slurm`'s script, submitted with `sbatch` to a real Slurm started by the test.

The Slurm is two nodes, `n1` and `n2`, both on this machine: a slurmctld and one slurmd per
node (`slurmd -N`), with `auth/none`, so no munge. A two-node job is then what it is on two
machines: the script starts the Ray head on n1 through `srun`, joins n2's Ray node to it, and
runs the command, a driver that places one worker on each Ray node.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from rl_distributed.launchers import CHECKPOINT_DEADLINE_ENV

# About 3 min on a shared 2-core machine; Ray starts much slower when other work takes the CPUs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SLURM_COMMANDS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
INSTALL_HINT = (
    "install it with `DEBIAN_FRONTEND=noninteractive apt-get install -y "
    "--no-install-recommends slurm-wlm` (as root; .ci/run does this)"
)
NODES = ("n1", "n2")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

DRIVER = textwrap.dedent(
    """
    import json, os, ray
    from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
    from rl_distributed.virtual_cluster import init_ray

    init_ray()  # the job's cluster, through the RAY_ADDRESS the script exported
    cluster = RayVirtualCluster([1, 1], use_gpus=False, placement_group_strategy="STRICT_SPREAD")
    group = RayWorkerGroup(cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"))
    envs = group.call_all("env")
    echoed = group.get_all_worker_results(
        group.run_all_workers_multiple_data("echo", rank=[0, 1])
    )
    print("DRIVER " + json.dumps({
        "gcs": ray.get_runtime_context().gcs_address,
        "alive_ray_nodes": sum(n["Alive"] for n in ray.nodes()),
        "worker_nodes": [m.placement["node_id"] for m in group.worker_metadata],
        "node_ranks": [e["NODE_RANK"] for e in envs],
        "echoed": echoed,
        "deadline": os.environ.get("{deadline_env}"),
    }), flush=True)
    group.shutdown()
    cluster.shutdown()
    """
).replace("{deadline_env}", CHECKPOINT_DEADLINE_ENV)


def free_port() -> int:
    """An ephemeral port: outside Ray's worker-port range (10002-19999) too."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_ray_refuses() -> int:
    """A free port in Ray's worker-port range, which `ray start --head --port` refuses. (Free,
    so that nothing else answers on it: the script must see the head exit, not another
    program's open port.)"""
    for port in range(15000, 20000):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15000-19999")


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]
    jobs: list[str] = field(default_factory=list)

    def run(self, *command: str) -> str:
        out = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {out.stderr.strip()}")
        return out.stdout

    def submit(self, script: str, name: str) -> str:
        path = self.root / f"{name}.sbatch"
        path.write_text(script)
        job = self.run("sbatch", "--parsable", f"--output={self.root}/{name}-%j.out", str(path))
        self.jobs.append(job.strip().split(";")[0])
        return self.jobs[-1]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (one line with -o: KEY=VALUE pairs)."""
        line = self.run("scontrol", "-o", "show", "job", job_id).strip()
        return dict(pair.split("=", 1) for pair in line.split() if "=" in pair)

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended, or after ``timeout`` seconds (still running)."""
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while info["JobState"] not in TERMINAL_STATES and time.monotonic() < deadline:
            time.sleep(2)
            info = self.job(job_id)
        return info

    def log(self, name: str, job_id: str) -> str:
        path = self.root / f"{name}-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else "(no output file)"

    def daemon_logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.log"))
        )


def require_slurm() -> None:
    """A missing Slurm fails the slow tier in CI (which installs it) and skips elsewhere."""
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    problem = None
    if missing:
        problem = f"Slurm is not installed (missing {', '.join(missing)}): {INSTALL_HINT}"
    elif os.geteuid() != 0:
        problem = "slurmd starts job steps as their user: these tests run Slurm as root"
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(problem)
    pytest.skip(problem)


def slurm_conf(root: Path, ctld_port: int, node_ports: list[int]) -> str:
    user = getpass.getuser()
    cpus = os.cpu_count() or 1
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={cpus} RealMemory=1024"
        for name, port in zip(NODES, node_ports, strict=True)
    )
    return textwrap.dedent(
        f"""\
        ClusterName=rltest
        SlurmctldHost=localhost
        SlurmctldPort={ctld_port}
        AuthType=auth/none
        CredType=cred/none
        SlurmUser={user}
        SlurmdUser={user}
        StateSaveLocation={root}/state
        SlurmdSpoolDir={root}/spool/%n
        SlurmctldPidFile={root}/slurmctld.pid
        SlurmdPidFile={root}/slurmd-%n.pid
        SlurmctldLogFile={root}/slurmctld.log
        SlurmdLogFile={root}/slurmd-%n.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        JobAcctGatherType=jobacct_gather/none
        SelectType=select/cons_tres
        MpiDefault=none
        MailProg=/bin/true
        ReturnToService=2
        """
    ) + (f"{nodes}\nPartitionName=debug Nodes={','.join(NODES)} Default=YES State=UP\n")


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    require_slurm()
    # A short path under /tmp: Ray's socket paths under RAY_TMPDIR must stay under 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rl-slurm-", dir="/tmp"))
    for sub in ("state", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, free_port(), [free_port() for _ in NODES]))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
        "SLURM_CONF": str(conf),
        # What the job runs (`ray`, `python`) comes from this test's environment.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # Ray's session files and the "current cluster" pointer go to the test's directory,
        # not /tmp/ray, which other Ray clusters on this machine share.
        "RAY_TMPDIR": str(root),
        # Token auth is Ray's own business; with it on, concurrent local clusters on one
        # machine race to rewrite ~/.ray/auth_token.
        "RAY_AUTH_MODE": "disabled",
    }
    cluster = Slurm(root, env)
    daemons = [
        subprocess.Popen(
            ["slurmctld", "-D"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
    ]
    try:
        for node in NODES:
            daemons.append(
                subprocess.Popen(
                    ["slurmd", "-D", "-N", node],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_for_idle_nodes(cluster, daemons)
        yield cluster
    finally:
        stop(cluster, daemons)


def wait_for_idle_nodes(cluster: Slurm, daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 60
    states = ""
    while time.monotonic() < deadline:
        if any(d.poll() is not None for d in daemons):
            break
        try:
            states = cluster.run("sinfo", "-h", "-N", "-o", "%N %T")
        except RuntimeError as err:  # slurmctld not answering yet
            states = str(err)
        if sorted(states.split()) == sorted([*NODES, *["idle"] * len(NODES)]):
            return
        time.sleep(1)
    raise RuntimeError(f"Slurm's nodes never became idle: {states}\n{cluster.daemon_logs()}")


def stop(cluster: Slurm, daemons: list[subprocess.Popen]) -> None:
    """Cancel the jobs, stop the daemons this fixture started, then any Ray process of the
    jobs that outlived them (found by the RAY_TMPDIR only these jobs use)."""
    if cluster.jobs:
        subprocess.run(["scancel", *cluster.jobs], env=cluster.env, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["squeue", "-h", "-j", ",".join(cluster.jobs)],
                env=cluster.env,
                capture_output=True,
                text=True,
            )
            if out.returncode != 0 or not out.stdout.strip():
                break
            time.sleep(1)
    for daemon in reversed(daemons):
        daemon.terminate()
    for daemon in reversed(daemons):
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    for pid in processes_mentioning(str(cluster.root)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(cluster.root, ignore_errors=True)


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(proc.name))
    return found


def generated_script(*args: str) -> str:
    """What `rl-cluster slurm` prints, run as users run it."""
    out = subprocess.run(
        [sys.executable, "-m", "rl_distributed.cli", "slurm", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def show(title: str, log: str) -> str:
    """The job's log, printed (shown with -s, and by pytest when the test fails)."""
    text = f"===== {title} =====\n{log}"
    print(text)
    return text


def epoch(slurm_time: str) -> int:
    """Slurm prints local times without a zone, as `date -d` in the script reads them."""
    return int(datetime.fromisoformat(slurm_time).timestamp())


def test_the_job_starts_ray_joins_a_worker_and_runs_a_two_worker_group(slurm, tmp_path):
    driver = slurm.root / "driver.py"
    driver.write_text(DRIVER)
    port = free_port()
    common = ["--nodes", "2", "--gpus-per-node", "0", "--cpus-per-node", "1"]
    # A head whose `ray start` fails (Ray refuses a port in its own worker-port range): the
    # script must fail the job at once, not wait for the other nodes until the time limit.
    broken = slurm.submit(
        generated_script(
            *common, "--port", str(free_port_ray_refuses()), "--time", "00:10:00", "--", "true"
        ),
        "broken",
    )
    job = slurm.submit(
        generated_script(
            *common,
            "--port",
            str(port),
            "--time",
            "00:10:00",
            "--save-margin-minutes",
            "1",
            "--job-name",
            "rl-slurm-test",
            "--",
            "python",
            str(driver),
        ),
        "job",
    )

    # Before the job's 10-minute limit, which is when the script used to give up. (It takes
    # ~20 s; the rest is room for a machine busy with other work.)
    info = slurm.wait(broken, timeout=300)
    log = show(f"job {broken} (head cannot start): {info['JobState']}", slurm.log("broken", broken))
    assert info["JobState"] == "FAILED", log
    assert "rl-cluster: the Ray node on n1 exited before the cluster was up" in log

    info = slurm.wait(job, timeout=300)
    log = show(f"job {job}: {info['JobState']}", slurm.log("job", job))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["NodeList"] == "n[1-2]"
    [line] = [x for x in log.splitlines() if x.startswith("DRIVER ")]
    report = json.loads(line.removeprefix("DRIVER "))
    # The driver used the job's Ray cluster (head on the script's port), not one of its own.
    assert report["gcs"].endswith(f":{port}"), log
    assert report["alive_ray_nodes"] == 2  # the head and the worker node that joined it
    assert len(set(report["worker_nodes"])) == 2  # one worker on each Ray node
    assert report["node_ranks"] == ["0", "1"]
    assert report["echoed"] == [{"rank": 0}, {"rank": 1}]
    # The checkpoint deadline: the job's end (its start + --time) less the 1-minute margin.
    assert int(report["deadline"]) == epoch(info["StartTime"]) + 10 * 60 - 60
