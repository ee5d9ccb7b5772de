"""PyTorch's own ways to train on several devices, as baselines for hetrain's plans.

Run on every rank of a torchrun job (an emulated cluster's too), with the same model,
data, global batch and optimizer that ``hetrain train`` runs a plan with::

    torchrun --nproc-per-node 4 -m hetrain.baselines ddp --model gpt-tiny --global-batch 32 \\
        --steps 12 --metrics-out ddp.jsonl
    hetrain emulate run cluster.toml -- python -m hetrain.baselines pipelining --micro-batches 4 ...

``ddp``
    ``torch.nn.parallel.DistributedDataParallel``: one replica of the whole model per
    rank, the global batch split EVENLY over the ranks (what a DDP user does; it does
    not know one device is slower), gradients averaged by DDP's bucketed all-reduce.

``pipelining``
    ``torch.distributed.pipelining``: one ``PipelineStage`` per rank, rank ``j`` holding
    the ``j``-th of ``p`` as-equal-as-possible runs of layers (earlier stages take the
    extra layers), the global batch cut into ``m`` micro-batches by ``ScheduleGPipe`` or
    ``Schedule1F1B``.

    rank      0          1          2          3
           [L0..L2] -> [L3..L5] -> [L6..L7] -> [L8..L9]      (10 layers, p = 4)

A hand-made hybrid of the two (``build_hybrid_step``, the runtime-vs-torch benchmark's ``hybrid`` case;
not a command): ``d`` data-parallel replicas, each a ``torch.distributed.pipelining`` pipeline over its
ranks, each stage's module wrapped in ``DistributedDataParallel`` over the same stage of every replica
(``PipelineStage`` runs a DDP module under ``no_sync`` and arms its reducer for the last backward only)::

    replicas [[0, 2], [1, 3]]   pipelines 0 -> 2 and 1 -> 3; DDP over {0, 1} (stage 0) and {2, 3} (stage 1)

Every rank draws the same global batches (``iter_batches(train, global_batch, data_seed)``),
as hetrain's Trainer does, and builds its layers from the same per-layer seeds, so a
baseline starts from the same weights and sees the same samples as a plan.

The last rank writes ``--metrics-out``: a first line describing the run, then one JSON
line per step with ``step``, ``step_time_s``, ``samples_per_s``, ``loss`` (the same keys
as ``hetrain train --metrics-out``). A step's time is the time between the ends of two
steps on that rank, the optimizer step included. Every collective and point-to-point
transfer waits at most ``--timeout-s`` (the process group's timeout); a failure names
the rank, the step and the peers it was waiting on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.arguments import int_between, number_at_least
from hetrain.errors import RunError
from hetrain.fields import MAX_GLOBAL_BATCH, MAX_STEPS
from hetrain.options import add_options, build_options, given_options, option
from hetrain.profile import OPTIMIZER_ALIASES, OPTIMIZER_NAMES
from hetrain.runtime.config import RunOptions
from hetrain.sync_layout import REDUCE_DTYPES

BASELINES = ("ddp", "pipelining")
SCHEDULES = ("gpipe", "1f1b")


class BaselineError(RunError):
    """A baseline could not run: bad options for this world size, or a peer failed or timed out."""


def even_bounds(layers: int, parts: int) -> list[int]:
    """Stage boundaries ``[0, e_0, e_1, ..., layers]`` with layer counts as equal as possible, larger first.

    >>> even_bounds(10, 4)
    [0, 3, 6, 8, 10]
    """
    if parts < 1 or layers < parts:
        raise BaselineError(f"cannot split {layers} layers into {parts} stages of at least one layer each")
    q, r = divmod(layers, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + q + (1 if j < r else 0))
    return bounds


def _global_batches(data: Any, global_batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from hetrain.data.datasets import iter_batches

    return iter_batches(data, global_batch, seed)


def _bf16_allreduce_hook(world, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations
    """A DistributedDataParallel communication hook: the bucket's mean all-reduced in bfloat16, then copied back
    into its (fp32) buffer. What torch's ``bf16_compress_hook`` does, which refuses to run without NCCL (CUDA) or
    XCCL; this one runs on Gloo too. Unannotated: DDP checks the ``bucket`` annotation against
    ``dist.GradBucket``, which this module's postponed annotations would make a string."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(world)
    work = dist.all_reduce(low, async_op=True)

    def back(fut: Any) -> Any:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(back)


def build_ddp_step(model: str, config: dict[str, Any], global_batch: int, optimizer: Callable[..., Any],
                   seed: int, reduce_dtype: str = "fp32", **ddp_options: Any,
                   ) -> tuple[Callable[[Any], torch.Tensor], nn.Module]:
    """``step(global_batch) -> loss``: one DDP step of this rank on its even share of the batch; and the module.

    ``ddp_options`` go to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb_list``: its buckets' sizes);
    ``reduce_dtype`` ``bf16`` registers ``_bf16_allreduce_hook`` (each bucket all-reduced in bfloat16)."""
    from torch.nn.parallel import DistributedDataParallel

    from hetrain.data.sharding import shard_batch, split_evenly
    from hetrain.models.layers import LayerRange
    from hetrain.models.registry import build_layers, loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = split_evenly(global_batch, world)
    module = LayerRange(build_layers(model, seed=seed, **config))
    ddp = DistributedDataParallel(module, **ddp_options)
    if reduce_dtype == "bf16":  # fp32: DDP's own all-reduce (run_baseline checks the name)
        ddp.register_comm_hook(world, _bf16_allreduce_hook)
    opt = optimizer(list(ddp.parameters()))
    lossf = loss_fn(model)

    def step(batch: Any) -> torch.Tensor:
        x, y = shard_batch(batch, sizes, rank)
        opt.zero_grad()
        loss = lossf(ddp(x), y)
        torch.autograd.backward([loss])  # DDP averages the gradients over the ranks here
        opt.step()
        return loss.detach()

    return step, module


def build_pipelining_step(model: str, config: dict[str, Any], micro_batches: int, schedule: str,
                          optimizer: Callable[..., Any], seed: int, device: torch.device | None = None,
                          ) -> tuple[Callable[[Any], torch.Tensor], nn.Module]:
    """``step(global_batch) -> loss``: one step of this rank's stage of an even-split torch pipeline; the stage.

    ``device``: where the stage lives (default the CPU); the batch given to ``step`` must be there too."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hetrain.models.layers import LayerRange
    from hetrain.models.registry import build_layers, loss_fn, num_layers

    rank, p = dist.get_rank(), dist.get_world_size()
    b = even_bounds(num_layers(model, **config), p)
    device = torch.device("cpu") if device is None else device
    module = LayerRange(build_layers(model, b[rank], b[rank + 1], seed=seed, **config), b[rank]).to(device)
    stage = PipelineStage(module, rank, p, device)
    schedule_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    lossf = loss_fn(model)
    runner = schedule_cls(stage, micro_batches, loss_fn=lossf)  # scales gradients by 1/m: the batch mean
    opt = optimizer(list(module.parameters()))

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        losses = _schedule_step(runner, rank, p, x, y)
        opt.step()
        return torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)

    return step, module


def _schedule_step(runner: Any, stage: int, stages: int, x: Any, y: Any) -> list[torch.Tensor]:
    """One step of a pipelining schedule on this rank's stage ``stage`` of ``stages``: the first stage feeds the
    inputs, the last the targets; the last stage's micro-batch losses (none elsewhere)."""
    losses: list[torch.Tensor] = []
    if stages == 1:
        runner.step(x, target=y, losses=losses)
    elif stage == 0:
        runner.step(x)
    elif stage == stages - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    return losses


def interleaved_replicas(world: int, replicas: int) -> list[list[int]]:
    """The ranks of each of ``replicas`` pipelines over ``world`` ranks, stage order, the replica index varying
    fastest: stage ``j`` of replica ``v`` is rank ``j * replicas + v``. Megatron-LM's default rank order (data
    parallel inside pipeline parallel) and torchtitan's device mesh (``pp`` its outermost dimension) lay ranks
    out so; with the ranks in node order, each stage's replicas sit side by side (on one node, where it holds
    ``replicas`` devices) and each pipeline spans the nodes.

    >>> interleaved_replicas(4, 2)
    [[0, 2], [1, 3]]
    """
    if replicas < 1 or world % replicas:
        raise BaselineError(f"{world} ranks do not split into {replicas} pipelines of equal length")
    return [list(range(v, world, replicas)) for v in range(replicas)]


def _find_rank(replicas: Sequence[Sequence[int]], rank: int, world: int) -> tuple[int, int]:
    """``(replica, stage)`` of ``rank``; refuses replicas of unequal lengths, or that do not hold every rank of
    the ``world`` once."""
    if len({len(r) for r in replicas}) != 1 or sorted(r for ranks in replicas for r in ranks) != list(range(world)):
        raise BaselineError(f"replicas {[list(r) for r in replicas]} must be pipelines of equal length that hold "
                            f"each of the {world} ranks once")
    return next((v, list(ranks).index(rank)) for v, ranks in enumerate(replicas) if rank in ranks)


def build_hybrid_step(model: str, config: dict[str, Any], micro_batches: int, replicas: Sequence[Sequence[int]],
                      optimizer: Callable[..., Any], seed: int, timeout_s: float, schedule: str = "1f1b",
                      bounds: Sequence[int] | None = None,
                      ) -> tuple[Callable[[Any], torch.Tensor], nn.Module]:
    """``step(global_batch) -> loss``: one step of this rank's stage of a hand-made torch hybrid; the stage.

    ``replicas[v]``: the ranks of pipeline ``v`` in stage order (``interleaved_replicas``; every rank in one).
    Replica ``v`` trains on the ``v``-th of ``len(replicas)`` equal parts of the global batch, cut into
    ``micro_batches`` by ``schedule`` (``Schedule1F1B`` or ``ScheduleGPipe``) over a process group of its
    ranks; every stage's module (layers ``bounds[j]:bounds[j + 1]``, default ``even_bounds``) is wrapped in
    ``DistributedDataParallel`` (its defaults) over a group of that stage's ranks of every replica.
    ``PipelineStage`` runs a DDP module's forwards and all but the last backward under ``no_sync``, and arms
    its reducer (``prepare_for_backward``) for the last one: DDP averages over the replicas inside that
    backward, the schedule divides by ``micro_batches`` after it, the global batch's mean gradient. Every group
    is made with a timeout of ``timeout_s``, the wait of its collectives and transfers. The returned loss is
    the replica's mean (the last stage's; zero elsewhere). A global batch that does not split into equal
    micro-batches of equal parts is refused (BaselineError)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    from hetrain.data.sharding import batch_length, shard_batch
    from hetrain.models.layers import LayerRange
    from hetrain.models.registry import build_layers, loss_fn, num_layers

    rank, world = dist.get_rank(), dist.get_world_size()
    v, j = _find_rank(replicas, rank, world)
    d, p = len(replicas), len(replicas[0])
    wait = timedelta(seconds=timeout_s)
    # new_group is a collective of the whole job: every rank makes every group, in the same order
    pipes = [dist.new_group(list(ranks), timeout=wait) for ranks in replicas]
    dps = [dist.new_group([ranks[k] for ranks in replicas], timeout=wait) for k in range(p)]
    b = list(bounds) if bounds is not None else even_bounds(num_layers(model, **config), p)
    module = LayerRange(build_layers(model, b[j], b[j + 1], seed=seed, **config), b[j])
    ddp = DistributedDataParallel(module, process_group=dps[j])
    stage = PipelineStage(ddp, j, p, torch.device("cpu"), group=pipes[v])
    schedule_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    runner = schedule_cls(stage, micro_batches, loss_fn=loss_fn(model))
    opt = optimizer(list(module.parameters()))

    def step(batch: Any) -> torch.Tensor:
        n = batch_length(batch)
        if n % (d * micro_batches):
            raise BaselineError(f"a global batch of {n} does not split into {d} replicas of {micro_batches} equal "
                                "micro-batches")
        x, y = shard_batch(batch, [n // d] * d, v)
        opt.zero_grad()
        # the stage runs every forward under no_sync already; the step under it too keeps the one forward it does
        # not (torch 2.13's shape inference, the first step's, through the DDP module) from arming the reducer
        # for the first backward: that backward would all-reduce, and the next forward fail DDP's bucket rebuild
        # ("rebuilt parameter indices size is not same as original model parameters size"). The last backward
        # is armed by the stage itself (prepare_for_backward), inside or outside no_sync.
        with ddp.no_sync():
            losses = _schedule_step(runner, j, p, x, y)
        opt.step()
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    return step, module


@dataclass(frozen=True)
class BaselineConfig(RunOptions):
    """A torch baseline's run: the seeds, model settings and waits of ``hetrain train`` (``RunOptions``), and
    what the baseline itself takes. ``kind`` is the positional ``ddp`` or ``pipelining``."""

    kind: str = "ddp"
    model: str = option("gpt-tiny")
    """reference model (default gpt-tiny)"""
    data: str | None = option(None)
    """data set (default: the real one that fits the model)"""
    global_batch: int = option(32, type=int_between(1, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"))
    """samples per step over all ranks (default 32)"""
    steps: int = option(10, type=int_between(1, MAX_STEPS, "MAX_STEPS"))
    """steps to train (default 10)"""
    micro_batches: int = option(4, type=int_between(1, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"))
    """m, pipelining only (default 4)"""
    schedule: str = option("1f1b", choices=SCHEDULES)
    """pipelining only (default 1f1b)"""
    optimizer: str = option("sgd", choices=(*OPTIMIZER_NAMES, *OPTIMIZER_ALIASES))
    """as hetrain train's (default sgd)"""
    lr: float | None = option(None, type=number_at_least(0.0, inclusive=False))
    """learning rate (default as hetrain train's)"""
    metrics_out: str | None = option(None)
    """per-step rows, JSONL (written by the last rank)"""
    weights_out: str | None = option(None)
    """directory for each rank's state_dict"""
    reduce_dtype: str = option(REDUCE_DTYPES[0], choices=REDUCE_DTYPES)
    """ddp: all-reduce the gradient buckets in bf16 (as hetrain's sync option reduce_dtype)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in BASELINES:
            raise BaselineError(f"unknown baseline {self.kind!r}; known: {', '.join(BASELINES)}")


def _check_world(c: BaselineConfig, world: int) -> None:
    """Refuse a global batch DDP cannot split over the ranks, micro-batches pipelining cannot make, and a reduce
    dtype other than fp32 for pipelining."""
    if c.kind == "ddp" and c.global_batch < world:
        raise BaselineError(f"a global batch of {c.global_batch} cannot be split over {world} DDP replicas")
    if c.kind == "pipelining" and c.global_batch % c.micro_batches:
        raise BaselineError(f"torch pipelining needs equal micro-batches: global batch {c.global_batch} does not "
                            f"split into {c.micro_batches}")
    if c.reduce_dtype != REDUCE_DTYPES[0] and c.kind != "ddp":
        raise BaselineError(f"--reduce-dtype {c.reduce_dtype}: one of {', '.join(REDUCE_DTYPES)}, and other than "
                            f"{REDUCE_DTYPES[0]} for the ddp baseline only")


def run_baseline(c: BaselineConfig) -> list[dict[str, Any]]:
    """Train ``c.model`` with the torch baseline ``c.kind`` on this rank of a torchrun job; the per-step rows.

    Every collective and transfer waits at most ``c.timeout_s``; ``c.weights_out``: a directory where every rank
    saves its module's ``state_dict`` as ``rank{r}.pt``; the last rank writes ``c.metrics_out`` (module docstring).

    Returns:
        The rows on every rank; ``loss`` is the batch's mean loss (summed over the ranks at the end).

    Raises:
        BaselineError: bad options, or a step failed or timed out (names the rank, the step and the peers).
    """
    from hetrain.data.registry import build_datasets, default_data
    from hetrain.runtime.trainer import build_optimizer_fn

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=c.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    _check_world(c, world)
    config = c.model_settings()
    opt_fn = build_optimizer_fn(c.optimizer, c.lr)
    if c.kind == "ddp":
        step, module = build_ddp_step(c.model, config, c.global_batch, opt_fn, c.seed, reduce_dtype=c.reduce_dtype)
        peers = f"ranks {', '.join(str(r) for r in range(world) if r != rank)} (DDP's all-reduce)"
    else:
        step, module = build_pipelining_step(c.model, config, c.micro_batches, c.schedule, opt_fn, c.seed)
        peers = "stage ranks " + ", ".join(str(r) for r in (rank - 1, rank + 1) if 0 <= r < world)
    train = build_datasets(c.data or default_data(c.model, **config), c.model, seed=c.data_seed, **config).train
    batches = _global_batches(train, c.global_batch, c.data_seed)
    rows: list[dict[str, Any]] = []
    losses: list[torch.Tensor] = []
    t_prev = time.perf_counter()
    for s in range(c.steps):
        try:
            losses.append(step(next(batches)))
        except RuntimeError as e:  # DistBackendError (a timeout) is one
            raise BaselineError(f"{c.kind} baseline, rank {rank} of {world}: step {s} failed or timed out "
                                f"({c.timeout_s:g} s) waiting on {peers}: {e}") from None
        t_end = time.perf_counter()
        rows.append({"step": s + 1, "step_time_s": t_end - t_prev,
                     "samples_per_s": c.global_batch / (t_end - t_prev), "loss": None})
        t_prev = t_end
    # the losses once, after the timed steps: DDP's mean over the replicas, the last stage's alone for pipelining
    buf = torch.stack(losses)
    dist.all_reduce(buf)
    for row, value in zip(rows, (buf / world if c.kind == "ddp" else buf).tolist(), strict=True):
        row["loss"] = float(value)
    if c.weights_out is not None:
        Path(c.weights_out).mkdir(parents=True, exist_ok=True)
        torch.save(module.state_dict(), Path(c.weights_out) / f"rank{rank}.pt")
    if c.metrics_out is not None and rank == world - 1:
        _write_rows(c, world, rows)
    return rows


def _write_rows(c: BaselineConfig, world: int, rows: list[dict[str, Any]]) -> None:
    """The metrics file, atomically: a line describing the run, then one line per step."""
    from hetrain.models.registry import num_layers

    head = {"baseline": c.kind, "runtime": "torch " + torch.__version__, "model": c.model, "ranks": world,
            "global_batch": c.global_batch, "optimizer": c.optimizer, "reduce_dtype": c.reduce_dtype}
    if c.kind == "pipelining":
        head.update(micro_batches=c.micro_batches, schedule=c.schedule,
                    stage_bounds=even_bounds(num_layers(c.model, **c.model_settings()), world))
    path = Path(str(c.metrics_out))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    os.replace(tmp, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``python -m hetrain.baselines``' options: the kind, and ``BaselineConfig``'s."""
    parser.add_argument("kind", choices=BASELINES)
    add_options(parser, BaselineConfig)


def run(args: argparse.Namespace) -> int:
    """Run a baseline from parsed ``add_arguments`` options on this rank; the exit status (module docstring)."""
    torch.set_num_threads(1)
    try:
        c = build_options(BaselineConfig, given_options(args, BaselineConfig))
        rows = run_baseline(replace(c, kind=args.kind))
    except (BaselineError, ValueError) as e:
        print(f"hetrain.baselines: error: {e}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)  # a group with a failed peer cannot be torn down cleanly
    if dist.get_rank() == dist.get_world_size() - 1:
        rates = sorted(r["samples_per_s"] for r in rows[1:]) or [rows[0]["samples_per_s"]]
        print(f"hetrain.baselines: {args.kind}, {dist.get_world_size()} ranks, steps 1 -> {len(rows)}, loss "
              f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, {rates[len(rates) // 2]:.1f} samples/s (median)",
              flush=True)
    # Every rank passes the barrier before any leaves: torch pipelining can leave a peer's last
    # receive posted, and a rank tearing the group down under it aborts that peer at exit.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the group's C++ teardown, which can abort ("terminate called") at interpreter exit


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.baselines ddp|pipelining ...`` on every rank of a torchrun job: ``hetrain baseline``
    (the one command line, ``hetrain.cli``)."""
    from hetrain.cli import main as cli_main

    return cli_main(["baseline", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
