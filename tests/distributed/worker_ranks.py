"""Launch one worker script as N ranks on this host and check they all succeed.

Shared by the multi-rank runtime tests; every rank gets its own process group of
processes, killed if it outlives the timeout.

The ranks are forked from a fork server (``multiprocessing``'s ``forkserver``) that has imported torch
and hetrain once for the session and never runs a torch op, so it has no thread pool or process group
a fork could copy half-way. A fresh interpreter spends about 4 s of CPU importing them; on 2 cores, with
4 ranks per launch, that was most of a small test's time. Each rank is still a process of its own with
its own Gloo process group: it starts a session of its own (``os.setsid``), takes its environment from
the launch (``RANK``, ``MASTER_PORT``, ...), runs the worker as ``__main__`` with ``sys.argv`` set, and
writes its stdout and stderr to files the launcher reads.

    pytest ──► fork server (torch, hetrain imported) ──fork──► rank 0: setsid, env, worker.py
                                                     ──fork──► rank 1: ...
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

#: what the fork server imports once: torch, the hetrain modules the worker scripts import, transformers' models
#: (where it is installed). The modules read the environment when called, not at import, and the ranks' environment
#: is this process's (plus RANK_VARIABLES and HETRAIN_NODE), as the fork server's is.
PRELOAD = ["torch", "torch.distributed", "numpy", "hetrain", "hetrain.runtime", "hetrain.runtime.trainer",
           "hetrain.runtime.config", "hetrain.plan", "hetrain.models.user", "hetrain.models.registry",
           "hetrain.data.registry", "hetrain.data.datasets", "transformers", "transformers.modeling_utils",
           "hetrain.models.hf", "worker_ranks"]
#: the variables of this process's environment a rank does not inherit: each launch sets its own
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")

_context: multiprocessing.context.ForkServerContext | None = None
_ready = False


def start_fork_server() -> multiprocessing.context.ForkServerContext:
    """Start the session's fork server, preloading ``PRELOAD``, and return at once (it imports them meanwhile:
    tests/distributed/conftest.py starts it while pytest collects the tests)."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        # one OpenMP / OpenBLAS thread, as in every rank: the server then imports torch and numpy without
        # starting a thread pool, and forks from one thread
        threads, os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS"), "1"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if threads is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = threads
        _context = context
    return _context


def fork_server() -> multiprocessing.context.ForkServerContext:
    """The session's fork server context, once the server has imported ``PRELOAD`` (the first call forks a child
    that does nothing, and waits for it), so that no test times that."""
    global _ready
    context = start_fork_server()
    if not _ready:
        ready = context.Process(target=int, name="fork-server-ready")
        ready.start()
        ready.join()
        _ready = True
    return context


def rank_env(nodes: str, world: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment as a launch's ranks share it (each adds its RANK and LOCAL_RANK)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HETRAIN_NODE=nodes, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(world), **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(script: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked rank: a session of its own, the rank's environment and working directory, stdout and stderr
    to ``log``.{out,err} (unbuffered, as PYTHONUNBUFFERED=1 makes them), then ``python SCRIPT ARGV`` (``SCRIPT``
    ``-m``: ``python -m MODULE ARGV[1:]``) run in this process."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, name in ((1, "out"), (2, "err")):
        target = os.open(f"{log}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    try:
        if script == "-m":  # as ``python -m``: the working directory first on the path, argv[0] the module's file
            sys.argv = list(argv)
            sys.path.insert(0, cwd)
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *argv]
            sys.path.insert(0, str(Path(script).parent))  # as ``python SCRIPT`` puts the script's folder first
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # the interpreter's exit would; a forked child leaves by os._exit


class Rank:
    """One forked rank: its process (``pid`` leads its process group), its log files, its exit code."""

    def __init__(self, script: Path | str, argv: Sequence[str], env: dict[str, str], log_dir: Path,
                 rank: int) -> None:
        self.log = log_dir / f"rank{rank}"
        self.process = fork_server().Process(target=_rank_main, name=f"rank{rank}",
                                             args=(str(script), list(argv), env, os.getcwd(), str(self.log)))
        self.process.start()

    @property
    def pid(self) -> int:
        return int(self.process.pid)  # type: ignore[arg-type]

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Wait for the rank to exit, as ``Popen.communicate`` does: its stdout and stderr; raises
        ``subprocess.TimeoutExpired`` if it still runs after ``timeout`` seconds."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        return self.output("out"), self.output("err")

    def output(self, name: str) -> str:
        """What the rank wrote to ``name``, ``"out"`` or ``"err"``."""
        path = Path(f"{self.log}.{name}")
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        """Kill the rank's process group if it still runs, and reap the rank."""
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()  # in case it had not reached its setsid
        self.process.join()


def start_ranks(script: Path, argv: Sequence[str], envs: Sequence[dict[str, str]], log_dir: Path) -> list[Rank]:
    """Fork one rank of ``python SCRIPT ARGV`` per environment in ``envs``."""
    ranks: list[Rank] = []
    try:
        for r, env in enumerate(envs):
            ranks.append(Rank(script, argv, env, log_dir, r))
    except BaseException:
        for rank in ranks:
            rank.kill()
        raise
    return ranks


def wait_ranks(ranks: Sequence[Rank], timeout_s: float) -> list[int]:
    """Wait for every rank, ``timeout_s`` for all of them together; kill them all in any case (each rank's
    process group). Their exit codes; raises TimeoutError, with every rank's stderr, for any still running."""
    deadline = time.monotonic() + timeout_s
    try:
        for rank in ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
        late = [r for r, rank in enumerate(ranks) if rank.returncode is None]
    finally:
        for rank in ranks:
            rank.kill()
    if late:
        errs = "\n".join(f"rank {r} stderr:\n{rank.output('err')[-2000:]}" for r, rank in enumerate(ranks))
        raise TimeoutError(f"ranks {late} still ran after {timeout_s:g} s (killed)\n{errs}")
    return [int(rank.returncode) for rank in ranks]  # type: ignore[arg-type]


def run_ranks(script: Path | str, argv: Sequence[str], world: int, timeout_s: float,
              env: dict[str, str] | None = None, cwd: Path | None = None,
              local_ranks: Sequence[int] | None = None) -> list[str]:
    """Fork ``python SCRIPT ARGV`` (``SCRIPT`` ``"-m"``: ``python -m ARGV``) as ``world`` Gloo ranks, with the
    variables torchrun gives its workers (on ``env``, default this process's environment; ``local_ranks``:
    each rank's LOCAL_RANK, default its rank, one host), in ``cwd`` (default this process's); assert every rank
    exits 0. Their stdout, by rank."""
    local = list(range(world)) if local_ranks is None else list(local_ranks)
    base = {**(env if env is not None else rank_env("n0", world, 0)), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(max(local) + 1)}
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(local[r])} for r in range(world)]
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        here = os.getcwd()
        os.chdir(cwd or here)  # a rank starts in the launcher's working directory
        try:
            ranks = start_ranks(Path(script), argv, envs, Path(logs))
        finally:
            os.chdir(here)
        codes = wait_ranks(ranks, timeout_s)
        for r, (code, rank) in enumerate(zip(codes, ranks, strict=True)):
            assert code == 0, f"rank {r} exited {code}:\n{rank.output('err')[-2000:]}\n{rank.output('out')[-2000:]}"
        return [rank.output("out") for rank in ranks]


def run_worker_ranks(root: Path, nodes: str, local_ranks: Sequence[int], timeout_s: float = 120,
                     args: Sequence[str] | None = None) -> None:
    """Run ``root/worker.py root/cases.json`` (or ``root/worker.py ARGS``) as ``len(local_ranks)`` Gloo ranks
    (``run_ranks``); assert every rank exits 0.

    ``nodes`` is HETRAIN_NODE: one node name, or a comma list indexed by rank.
    """
    run_ranks(root / "worker.py", [str(root / "cases.json")] if args is None else args, len(local_ranks), timeout_s,
              rank_env(nodes, len(local_ranks), 0), local_ranks=local_ranks)


def single_process_mlp(steps: int, lr: float, **dataset_options: object) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference of the restart tests: mlp-digits in one process, SGD at ``lr``, batches of 16 of the seeded
    synthetic data (``dataset_options`` for ``build_datasets``), as the distributed job sees them: the weights
    after ``steps`` steps and every step's loss."""
    from hetrain.data.datasets import iter_batches
    from hetrain.data.registry import build_datasets
    from hetrain.models.layers import LayerRange
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.runtime.trainer import build_optimizer_fn

    net = LayerRange(build_layers("mlp-digits", seed=0))
    opt = build_optimizer_fn("sgd", lr)(list(net.parameters()))
    data = build_datasets("synthetic", "mlp-digits", seed=0, **dataset_options).train
    losses = []
    for x, y in iter_batches(data, 16, seed=0, steps=steps):
        opt.zero_grad()
        loss = loss_fn("mlp-digits")(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(net.state_dict()), losses
