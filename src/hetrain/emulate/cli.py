"""``hetrain emulate run | up | down | status``: the command line of the emulator.

    hetrain emulate run CLUSTER.toml [options] -- COMMAND...   up, run COMMAND on every node, always down
    hetrain emulate up CLUSTER.toml [options]                  up, and leave it up; prints its run id
    hetrain emulate run --attach RUN_ID -- COMMAND...          run COMMAND on a cluster left up
    hetrain emulate down [RUN_ID]                              remove one run, or every run's leftovers
    hetrain emulate status                                     what exists on this host

``python -m hetrain.emulate ...`` is the same. The CLI's ``emulate`` command (``hetrain.commands.emulate``)
calls ``add_emulate_arguments`` on its subparser and ``run_emulate_args`` on the parsed arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain.cluster import ClusterError, load_cluster
from hetrain.emulate.emulator import EmulatedCluster, check_permissions, list_runs, remove_run
from hetrain.emulate.launch import EmulationInterrupted, signals_raise
from hetrain.emulate.rootless import ROOTLESS_ENV, probe_user_namespaces, run_rootless
from hetrain.emulate.settings import THROTTLE_CHOICES, EmulationError, EmulationSettings, load_emulation_settings
from hetrain.units import UnitError, parse_time


def _err(message: str) -> None:
    print(f"hetrain emulate: {message}", file=sys.stderr, flush=True)


def load_settings(cluster_path: str | Path, **overrides: Any) -> EmulationSettings:
    """The ``[emulation]`` table of the file, with the given (non-None) fields replaced."""
    return load_emulation_settings(cluster_path).with_overrides(**overrides)


def run(cluster_path: str | Path, command: Sequence[str], settings: EmulationSettings | None = None,
        timeout_s: float | None = None, run_id: str | None = None, rootless: bool | None = None) -> int:
    """Emulate the cluster file, run ``command`` under torchrun on every node, tear everything down.

    Args:
        cluster_path: a cluster file; its ``[emulation]`` table is used unless ``settings`` is given.
        command: run on each node as torchrun's entrypoint (``--no-python``), e.g.
            ``["python", "-m", "hetrain.profiler.network", "-o", "measured.toml"]``.
        settings: replaces the file's ``[emulation]`` table.
        timeout_s: stop the job after this long (exit status 124).
        run_id: 6 hex digits naming the run's namespaces and cgroups (default: random).
        rootless: run inside a user namespace (hetrain.emulate.rootless): nothing outlives the run.
            None: only when not root.

    Returns:
        The job's exit status; 128 + signal number after SIGINT/SIGTERM/SIGHUP. Raises
        EmulationError / ClusterError when the cluster cannot be emulated (nothing is left behind).

    Example:
        >>> run("examples/clusters/small-hetero.toml", ["python", "-c", "print('hi')"])  # doctest: +SKIP
        0
    """
    command = list(command[1:] if list(command[:1]) == ["--"] else command)
    if not command:
        raise EmulationError("no command to run: give it after `--`, for example "
                             "`hetrain emulate run cluster.toml -- python -m hetrain.profiler.network -o m.toml`")
    cluster = load_cluster(cluster_path)
    settings = settings or load_emulation_settings(cluster_path)
    if rootless is None:
        rootless = os.geteuid() != 0
    if rootless and not os.environ.get(ROOTLESS_ENV):
        why = probe_user_namespaces()
        if why is not None:
            check_permissions("run")  # not root: raises, saying why and what to do
            raise EmulationError(f"cannot run rootless: {why}")
        _err("running inside a user namespace (rootless): the network is emulated; compute is throttled only "
             "where the host's cgroups are writable from there")
        return run_rootless(cluster_path, command, settings, timeout_s, run_id)
    with signals_raise():
        try:
            with EmulatedCluster(cluster, settings, source=str(Path(cluster_path).resolve()),
                                 run_id=run_id or "") as em:
                _err(em.describe())
                status = em.launch(command, timeout_s=timeout_s)
                _err(f"job finished with exit status {status}; removing run {em.run_id}")
                return status
        except EmulationInterrupted as e:
            _err(f"stopped by {e.args[0]}; the emulated cluster was removed")
            return 128 + e.signum


def run_emulate_command(subcommand: str, cluster_path: str | Path | None = None,
                        command: Sequence[str] = (), run_id: str | None = None, attach: bool = False,
                        timeout_s: float | None = None, rootless: bool | None = None, **overrides: Any) -> int:
    """The body of ``hetrain emulate SUBCOMMAND``: prints what it does, returns the exit status.

    Args:
        subcommand: ``run``, ``up``, ``down`` or ``status``.
        cluster_path: the cluster file (``run`` and ``up``; ``run`` with ``run_id`` needs none).
        command: for ``run``: the command to run on every node (a leading ``--`` is dropped).
        run_id: ``run`` with ``attach``: the run to launch on; ``run``/``up`` without: the new run's id
            (default random); ``down``: remove only this run.
        attach: ``run``: launch on the run ``run_id`` (left up by ``up``) instead of making one.
        timeout_s: ``run``: stop the job after this long (status 124).
        rootless: ``run``: inside a user namespace (None: only when not root).
        overrides: ``EmulationSettings`` fields replacing the file's ``[emulation]`` values (None: keep).

    Errors (EmulationError, ClusterError) are printed and give status 2; nothing is left behind.
    """
    try:
        if subcommand == "status":
            runs = list_runs()
            if not runs:
                print("no emulated cluster on this host")
            for r in runs:
                print(r.describe())
            return 0
        if subcommand == "down":
            runs = [r for r in list_runs() if run_id is None or r.run_id == run_id]
            if run_id is not None and not runs:  # a run id that names no run: bad input
                print(f"no emulated cluster with run id {run_id}")
                return 2
            if runs:
                check_permissions("down")
            failed = False
            for r in runs:
                problems = remove_run(r.run_id)
                for p in problems:
                    _err(p)
                failed |= bool(problems)
                print(f"removed run {r.run_id}: {len(r.namespaces)} namespaces, {len(r.cgroups)} cgroup trees, "
                      f"{r.processes} processes")
            if not runs:
                print("nothing to remove")
            return 1 if failed else 0
        if subcommand == "run" and attach:
            if run_id is None:
                raise EmulationError("--attach needs the run id of a cluster left up by `hetrain emulate up`")
            with signals_raise():
                try:
                    em = EmulatedCluster.attach(run_id)
                    return em.launch(command, timeout_s=timeout_s)
                except EmulationInterrupted as e:
                    _err(f"stopped by {e.args[0]}; run {run_id} stays up")
                    return 128 + e.signum
        if subcommand not in ("run", "up"):
            raise EmulationError(f"unknown subcommand {subcommand!r}; use run, up, down or status")
        if cluster_path is None:
            raise EmulationError(f"`hetrain emulate {subcommand}` needs a cluster file")
        settings = load_settings(cluster_path, **overrides)
        if subcommand == "run":
            return run(cluster_path, command, settings, timeout_s=timeout_s, run_id=run_id, rootless=rootless)
        em = EmulatedCluster(load_cluster(cluster_path), settings, source=str(Path(cluster_path).resolve()),
                             run_id=run_id or "")
        with signals_raise():
            try:
                em.up(keep=True)
            except EmulationInterrupted as e:
                return 128 + e.signum
        print(em.describe())
        print(f"run id {em.run_id}: run a job on it with `hetrain emulate run --attach {em.run_id} -- COMMAND...`, "
              f"remove it with `hetrain emulate down {em.run_id}`")
        return 0
    except (EmulationError, ClusterError) as e:
        _err(f"error: {e}")
        return 2


def _time(text: str) -> float:
    try:
        return parse_time(text, "time")
    except UnitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_emulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``run``/``up``/``down``/``status`` subcommands to the ``emulate`` parser.

    Every destination is named ``emulate_*``, so the options cannot clash with the CLI's own.
    """
    sub = parser.add_subparsers(dest="emulate_command", required=True, metavar="{run,up,down,status}")
    run_p = sub.add_parser("run", help="emulate a cluster file, run a command on every node under torchrun, "
                                       "tear down", description="Run COMMAND (after --) as torchrun's entrypoint "
                                       "on every node of the emulated cluster; always tear down.")
    up_p = sub.add_parser("up", help="emulate a cluster file and leave it up",
                          description="Build the emulated cluster and leave it up; prints its run id.")
    for p in (run_p, up_p):
        p.add_argument("emulate_cluster", nargs="?" if p is run_p else None, metavar="CLUSTER",
                       help="cluster file (TOML)")
        p.add_argument("--cpu-scale", type=float, default=None, dest="emulate_cpu_scale", metavar="X",
                       help="multiply every cpu_share by this")
        p.add_argument("--cpu-period", type=_time, default=None, dest="emulate_cpu_period_s", metavar="TIME",
                       help="cgroup CPU period, e.g. 10ms (default: the file's, else 10ms)")
        p.add_argument("--throttle", choices=THROTTLE_CHOICES, default=None, dest="emulate_throttle",
                       help="auto: cgroups if possible, else warn; cgroup: refuse without; off")
        p.add_argument("--no-shape", dest="emulate_shape", action="store_const", const=False, default=None,
                       help="do not shape links (plain veths)")
        p.add_argument("--shape-intra", action="store_const", const=True, default=None, dest="emulate_shape_intra",
                       help="also shape each node's loopback at its intra_link rate")
        p.add_argument("--rdzv-port", type=int, default=None, dest="emulate_rdzv_port", metavar="PORT",
                       help="rendezvous port (default 29400)")
        p.add_argument("--run-id", default=None, dest="emulate_run_id", metavar="RUN_ID",
                       help="6 hex digits naming the new run (default: random)")
    run_p.add_argument("--attach", metavar="RUN_ID", default=None, dest="emulate_attach",
                       help="run on a cluster left up by `up`")
    run_p.add_argument("--rootless", action="store_const", const=True, default=None, dest="emulate_rootless",
                       help="run inside a user namespace, also as root (the default without root): everything "
                            "goes with the run; cgroups only where writable from there")
    run_p.add_argument("--timeout", type=_time, default=None, dest="emulate_timeout_s", metavar="TIME",
                       help="stop the job after this long, e.g. 600s (exit status 124)")
    run_p.add_argument("emulate_job", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                       help="what every rank runs, after `--`")
    run_p.set_defaults(emulate_run_parser=run_p)
    down_p = sub.add_parser("down", help="remove an emulated cluster (default: every one on this host)")
    down_p.add_argument("emulate_run_id", nargs="?", default=None, metavar="RUN_ID", help="only this run")
    sub.add_parser("status", help="list the emulated clusters and leftovers on this host")


def run_emulate_args(args: argparse.Namespace) -> int:
    """Run the parsed ``hetrain emulate ...`` arguments (from ``add_emulate_arguments``)."""
    sub = args.emulate_command
    if sub in ("down", "status"):
        return run_emulate_command(sub, run_id=getattr(args, "emulate_run_id", None))
    if sub == "up":
        return run_emulate_command("up", args.emulate_cluster, run_id=args.emulate_run_id, **_overrides(args))
    command = list(args.emulate_job)
    if "--" in command:
        # argparse's REMAINDER starts at the first word after the cluster file, so options written
        # between the file and `--` land in it: parse them now, the command is what follows `--`
        cut = command.index("--")
        options, command = command[:cut], command[cut + 1:]
        if options:
            cluster = args.emulate_cluster
            args.emulate_run_parser.parse_args(options, namespace=args)
            args.emulate_cluster = cluster
    cluster = args.emulate_cluster
    if args.emulate_attach is not None and cluster is not None:
        # `run --attach ID -- CMD...`: with no cluster file to take, argparse gives CMD's first word
        # to the optional positional; it belongs to the command
        command, cluster = [cluster, *command], None
    if (args.emulate_attach is None) == (cluster is None):
        _err("error: give either a cluster file or --attach RUN_ID")
        return 2
    if not command:
        _err("error: give the command to run after `--`, e.g. "
             "`hetrain emulate run cluster.toml -- python -m hetrain.profiler.network -o measured.toml`")
        return 2
    if args.emulate_attach is not None:
        return run_emulate_command("run", command=command, run_id=args.emulate_attach, attach=True,
                                   timeout_s=args.emulate_timeout_s)
    return run_emulate_command("run", cluster, command, run_id=args.emulate_run_id,
                               timeout_s=args.emulate_timeout_s, rootless=args.emulate_rootless, **_overrides(args))


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as options; every dest is prefixed so the CLI's own options cannot clash."""
    return {k: getattr(args, f"emulate_{k}") for k in ("cpu_scale", "cpu_period_s", "throttle", "shape",
                                                       "shape_intra", "rdzv_port")}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.emulate ...``: ``hetrain emulate ...`` (the one command line, ``hetrain.cli``)."""
    from hetrain.cli import main as cli_main

    return cli_main(["emulate", *(sys.argv[1:] if argv is None else argv)])
