"""``rl-cluster``: look at a Ray cluster, manage worker environments, write launch files.

Heavy imports (Ray, rich) happen inside the subcommands, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl-cluster", description="Inspect and grow the Ray cluster rl runs on."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status = commands.add_parser("status", help="nodes, resources, placement groups, object store")
    status.add_argument(
        "--address", help="Ray cluster address (default: RAY_ADDRESS, or the local one)"
    )
    status.set_defaults(handler=cmd_status)

    venvs = commands.add_parser(
        "venvs", help="the uv-built Python environments (virtualenvs) of worker groups"
    )
    env_commands = venvs.add_subparsers(dest="venvs_command", required=True, metavar="ACTION")
    build = env_commands.add_parser("build", help="build (or reuse) environments on this node")
    build.add_argument("names", nargs="+", help="environment names (vllm, mcore, or defined ones)")
    build.add_argument("--rebuild", action="store_true", help="rebuild even if cached")
    build.add_argument(
        "--upgrade",
        action="store_true",
        help="resolve the requirements anew instead of reusing the stored resolution",
    )
    build.add_argument(
        "--requirement",
        "-r",
        action="append",
        default=[],
        metavar="REQ",
        help="define NAME (a single one) as these requirements, e.g. -r 'six==1.16.0'",
    )
    build.set_defaults(handler=cmd_venvs_build)
    listing = env_commands.add_parser("list", help="environments cached on this node")
    listing.set_defaults(handler=cmd_venvs_list)
    clean = env_commands.add_parser("clean", help="delete cached environments")
    clean.add_argument("name", nargs="?", help="only this environment (default: all)")
    clean.set_defaults(handler=cmd_venvs_clean)

    slurm = commands.add_parser(
        "slurm", help="print an sbatch script that starts Ray and runs a command"
    )
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--gpus-per-node", type=int, default=8)
    slurm.add_argument("--cpus-per-node", type=int, default=64)
    slurm.add_argument("--time", default="04:00:00")
    slurm.add_argument("--job-name", default="rl")
    slurm.add_argument("--port", type=int, default=6379)
    slurm.add_argument(
        "--save-margin-minutes",
        type=int,
        default=10,
        help="rl runs save a checkpoint and stop this long before the job's --time ends",
    )
    slurm.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra #SBATCH line, e.g. --sbatch=--account=abc",
    )
    slurm.add_argument("job", nargs=argparse.REMAINDER, help="-- the command to run on the head")
    slurm.set_defaults(handler=cmd_slurm)

    kuberay = commands.add_parser("kuberay", help="print an example KubeRay RayCluster manifest")
    kuberay.add_argument("--workers", type=int, default=1, help="worker pods besides the head")
    kuberay.add_argument("--image", default="rayproject/ray:latest-gpu")
    kuberay.add_argument("--gpus-per-node", type=int, default=8)
    kuberay.add_argument("--cpus-per-node", type=int, default=64)
    kuberay.add_argument("--memory", default="512Gi")
    kuberay.add_argument("--name", default="rl")
    kuberay.add_argument("job", nargs=argparse.REMAINDER, help="-- the command the job runs")
    kuberay.set_defaults(handler=cmd_kuberay)
    return parser


def _job(args: argparse.Namespace) -> list[str]:
    return args.job[1:] if args.job[:1] == ["--"] else args.job


def cmd_status(args: argparse.Namespace) -> int:
    import ray
    from rich.console import Console

    from rl_distributed.cluster_status import render_status

    address = args.address or "auto"
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        print(f"rl-cluster: no Ray cluster at {address!r}: {err}", file=sys.stderr)
        return 1
    try:
        Console(width=None if sys.stdout.isatty() else 200).print(*render_status())
    finally:
        ray.shutdown()
    return 0


def cmd_venvs_build(args: argparse.Namespace) -> int:
    from rl_distributed import venvs

    if args.requirement:
        if len(args.names) != 1:
            print("rl-cluster: --requirement defines exactly one environment", file=sys.stderr)
            return 2
        venvs.define_env(args.names[0], requirements=args.requirement)
    for name in args.names:
        try:
            env = venvs.registry.get(name)
            resolution = venvs.resolve(env, upgrade=args.upgrade)
            python = venvs.ensure_env(
                env,
                rebuild=args.rebuild or venvs.rebuild_requested(env),
                resolution=resolution,
            )
        except (venvs.UnknownEnvError, venvs.EnvBuildError) as err:
            print(f"rl-cluster: {err}", file=sys.stderr)
            return 1
        print(f"{name}: {python}")
    return 0


def cmd_venvs_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from rl_distributed import venvs

    table = Table(title=f"worker environments in {venvs.cache_root()}")
    for column in ("name", "python", "ray", "spec", "size", "build s", "path"):
        table.add_column(column)
    for info in venvs.list_envs():
        spec = ", ".join([*(f"extra {e}" for e in info["extras"]), *info["requirements"]]) or "-"
        if info.get("pinned"):
            spec += f" ({len(info['pinned'])} pinned)"
        table.add_row(
            info["name"],
            info["python"],
            info["ray"],
            spec,
            f"{info['size_bytes'] / 2**20:.0f} MiB",
            str(info["build_seconds"]),
            info["path"],
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def cmd_venvs_clean(args: argparse.Namespace) -> int:
    from rl_distributed import venvs

    removed = venvs.clean_envs(args.name)
    for folder in removed:
        print(f"removed {folder}")
    if not removed:
        print("nothing to remove")
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    from rl_distributed.launchers import slurm_script

    print(
        slurm_script(
            _job(args),
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            cpus_per_node=args.cpus_per_node,
            time=args.time,
            job_name=args.job_name,
            port=args.port,
            sbatch_options=args.sbatch,
            save_margin_minutes=args.save_margin_minutes,
        ),
        end="",
    )
    return 0


def cmd_kuberay(args: argparse.Namespace) -> int:
    from rl_distributed.launchers import kuberay_manifest

    print(
        kuberay_manifest(
            _job(args),
            workers=args.workers,
            image=args.image,
            gpus_per_node=args.gpus_per_node,
            cpus_per_node=args.cpus_per_node,
            memory=args.memory,
            name=args.name,
        ),
        end="",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
