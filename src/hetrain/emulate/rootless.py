"""Rootless ``hetrain emulate run``: the whole run inside a user namespace where this user is root.

Without root, ``run`` re-starts itself as::

    unshare --user --map-root-user --mount --net --pid --fork --mount-proc --kill-child -- \\
        sh -c 'mount -t tmpfs hetrain-emulate /run && exec "$@"' sh  python -c <run(...)> <arguments as JSON>

Inside, the launcher is root of its own user namespace: it can make network
namespaces (their names live in the private tmpfs on /run), veths, a bridge and
tc qdiscs, all owned by that namespace (the launcher itself sits in an empty
network namespace of its own: ``ip netns`` must be able to return to it). Everything belongs to the user
namespace and its PID namespace, so the kernel removes it all when the run
ends, even if the launcher is killed. What it cannot do is write the host's
cgroups (as root, with ``--rootless``, it can), so compute is not throttled and
the run says so. ``up`` and ``down`` need root: a rootless cluster lives only as
long as its ``run``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hetrain.emulate.settings import EmulationError, EmulationSettings

ROOTLESS_ENV = "HETRAIN_EMULATE_ROOTLESS"  # set inside the user namespace
_ENTRY = ("import json, sys; from hetrain.emulate.rootless import run_from_json; "
          "sys.exit(run_from_json(sys.argv[1]))")


def rootless_prefix() -> list[str]:
    """The argv prefix that runs a command in a fresh user, mount and PID namespace with a private /run."""
    return ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--mount-proc",
            "--kill-child", "--", "sh", "-c", 'mount -t tmpfs hetrain-emulate /run && exec "$@"', "sh"]


def probe_user_namespaces() -> str | None:
    """None where this user can make the namespaces of ``rootless_prefix``; else why not."""
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    try:
        done = subprocess.run([*rootless_prefix(), "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare` failed: {e}"
    if done.returncode != 0:
        return (f"this host does not let users make user namespaces ({done.stderr.strip() or 'unshare failed'}; "
                "see the sysctls kernel.unprivileged_userns_clone, user.max_user_namespaces and AppArmor's "
                "kernel.apparmor_restrict_unprivileged_userns)")
    return None


def run_rootless(cluster_path: str | Path, command: list[str], settings: EmulationSettings,
                 timeout_s: float | None, run_id: str | None) -> int:
    """Run ``cli.run`` with these arguments inside a user namespace; its exit status.

    SIGINT, SIGTERM and SIGHUP that reach this process are passed on to the run inside,
    which tears down as usual; if that is killed, the kernel removes its namespaces.
    """
    from hetrain.emulate.launch import EmulationInterrupted, signals_raise

    payload = json.dumps({"cluster_path": str(Path(cluster_path).resolve()), "command": list(command),
                          "settings": settings.to_dict(), "timeout_s": timeout_s, "run_id": run_id})
    env = {**os.environ, ROOTLESS_ENV: "1"}
    p = subprocess.Popen([*rootless_prefix(), sys.executable, "-c", _ENTRY, payload], env=env,
                         start_new_session=True)
    with signals_raise():
        while True:
            try:
                return p.wait()
            except EmulationInterrupted as e:
                try:
                    os.killpg(p.pid, e.signum)
                except ProcessLookupError:
                    return 128 + e.signum


def run_from_json(text: str) -> int:
    """Inside the user namespace: ``cli.run`` with the arguments ``run_rootless`` passed."""
    from hetrain.cluster import ClusterError
    from hetrain.emulate.cli import run

    args: dict[str, Any] = json.loads(text)
    try:
        return run(args["cluster_path"], args["command"], EmulationSettings.from_dict(args["settings"]),
                   timeout_s=args["timeout_s"], run_id=args["run_id"])
    except (EmulationError, ClusterError) as e:
        print(f"hetrain emulate: error: {e}", file=sys.stderr, flush=True)
        return 2
