"""One-host emulated cluster: a network namespace per node, shaped links, throttled devices.

A cluster file becomes, on one Linux host (as root)::

    node "fast" ─► netns + veth ─┐                       each device ─► one rank process
    node "slow" ─► netns + veth ─┼─ bridge (hub netns)   in a cgroup with CPU quota
                                 │                       = cpu_share x period
    NIC / [[link]] rates ─► tc htb on both ends of each veth

and a job runs on it the way it runs on a real multi-node cluster: one
``torchrun`` per node, inside the node's namespace, joined by c10d rendezvous.
The job does not know it is emulated (DESIGN.md decision 8); it sees
``HETRAIN_NODE`` (its node's name) and torchrun's usual variables.

Example:
    >>> from hetrain.emulate import run                                  # doctest: +SKIP
    >>> run("examples/clusters/small-hetero.toml",                       # doctest: +SKIP
    ...     ["python", "-m", "hetrain.profiler.network", "-o", "measured.toml"])
    0

Modules: ``settings`` (the ``[emulation]`` table), ``network`` (namespaces, veths,
tc), ``cgroups`` (CPU quota, v1 and v2), ``emulator`` (``EmulatedCluster``, run
bookkeeping), ``launch`` (torchrun per node), ``keepawake`` (idle CPUs poll while a
job runs), ``rankwrap`` (per-rank cgroup join),
``rootless`` (runs without root, in a user namespace), ``cli`` (``hetrain emulate``).
docs/emulate.md is the guide.

The names below are imported on first use, so that ``python -m
hetrain.emulate.rankwrap``, which every rank runs, loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetrain.emulate.cli import add_emulate_arguments, run, run_emulate_args, run_emulate_command
    from hetrain.emulate.emulator import EmulatedCluster, RunStatus, list_runs, remove_run
    from hetrain.emulate.launch import EmulationInterrupted, build_torchrun_command, launch_job
    from hetrain.emulate.settings import (
        EmulationError,
        EmulationSettings,
        load_emulation_settings,
        parse_emulation_settings,
    )

_WHERE = {
    "add_emulate_arguments": "cli", "run": "cli", "run_emulate_args": "cli", "run_emulate_command": "cli",
    "EmulatedCluster": "emulator", "RunStatus": "emulator", "list_runs": "emulator", "remove_run": "emulator",
    "EmulationInterrupted": "launch", "build_torchrun_command": "launch", "launch_job": "launch",
    "EmulationError": "settings", "EmulationSettings": "settings", "load_emulation_settings": "settings",
    "parse_emulation_settings": "settings",
}

__all__ = [
    "EmulatedCluster", "EmulationError", "EmulationInterrupted", "EmulationSettings", "RunStatus",
    "add_emulate_arguments", "build_torchrun_command", "launch_job", "list_runs", "load_emulation_settings",
    "parse_emulation_settings", "remove_run", "run", "run_emulate_args", "run_emulate_command",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hetrain.emulate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrain.emulate.{_WHERE[name]}"), name)
