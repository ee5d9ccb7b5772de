"""hetrain's executor against torch's Schedule1F1B where the host's work per micro-batch is the bottleneck.

A GPU pipeline of small layers and many micro-batches is bound by kernel launches and
the runtime's own Python between them, not by the kernels: there the runtime's cost
per action is the step's cost. On one device (one rank: a single GPU cannot hold two
NCCL ranks), a stage holding the whole model runs a batch in many micro-batches, its
gradients accumulated over them, under both runtimes side by side in the same process,
taking turns block by block (ABBA), the batch already on the device for both:

    hetrain   Trainer, one VW of one stage, m micro-batches (1F1B)
    torch     PipelineStage + Schedule1F1B, one stage, m micro-batches

    python benchmarks/launch_bound.py [--device cuda] [--micro-batches 64] [--repeats 3]

On the CPU (``--device cpu``, the default without a GPU) the same small layers make
the step bound by per-micro-batch overhead too. Each repeat is its own process; the
table gives each repeat's median over paired blocks of torch's block time / hetrain's
(> 1: hetrain faster), then the spread of those medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from _results import write_section
from _vs_torch import (
    LR,
    add_repeat_arguments,
    build_plan,
    local_cluster,
    paired_ratio,
    read_repeat_arguments,
    spawn_job,
    take_turns,
)
from hetrain.baselines import build_pipelining_step
from hetrain.models.registry import num_layers, sample_batch
from hetrain.models.user import resolve_model
from hetrain.runtime import Trainer, build_optimizer_fn
from hetrain.runtime.config import LoggingConfig, TrainConfig

#: small layers: gpt-tiny 64 wide, 32 tokens, 8 blocks (10 layers)
SMALL = {"hidden": 64, "seq_len": 32, "heads": 2, "n_blocks": 8}


def timed_blocks(args: argparse.Namespace, device: torch.device) -> dict[str, list[float]]:
    """Both runtimes built in this process (rank 0 of 1), warmed up, then timed block by block, taking turns."""
    batch = tuple(t.to(device) for t in sample_batch(args.model, args.global_batch,
                                                     torch.Generator().manual_seed(0), **args.config))
    plan = build_plan("1f1b", args, num_layers(args.model, **args.config), local_cluster(1))
    trainer = Trainer(resolve_model(args.model, **args.config), plan,
                      TrainConfig(timeout_s=120, logging=LoggingConfig(progress=False, log_every=args.block_steps)),
                      optimizer_fn=build_optimizer_fn("sgd", LR))
    torch_step, _ = build_pipelining_step(args.model, args.config, args.micro_batches, "1f1b",
                                          build_optimizer_fn("sgd", LR), seed=0, device=device)

    data = itertools.repeat(batch)

    def hetrain_run(k: int) -> None:
        trainer.fit(data, trainer.step + k)

    def torch_run(k: int) -> None:
        for _ in range(k):
            torch_step(batch)

    runs = {"hetrain": hetrain_run, "torch": torch_run}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return take_turns(runs, args, sync)


def worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      HETRAIN_NODE="n0")
    torch.set_num_threads(1)
    on_cuda = args.device == "cuda"
    dist.init_process_group("nccl" if on_cuda else "gloo")
    blocks = timed_blocks(args, torch.device("cuda", 0) if on_cuda else torch.device("cpu"))
    with open(out_path, "w") as f:
        json.dump(blocks, f)
    os._exit(0)  # the process group's C++ teardown can abort at exit (hetrain.baselines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add_repeat_arguments(parser, SMALL, "small layers", global_batch=128, micro_batches=64)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu")
    read_repeat_arguments(parser, args, SMALL)
    return args


def main() -> int:
    args = parse_args()
    samples = args.global_batch * args.block_steps
    rows = ["| repeat | hetrain samples/s | torch samples/s | hetrain / torch (paired blocks: median, quartiles) |",
            "|---|---:|---:|---:|"]
    medians = []
    for k in range(args.repeats):
        blocks = spawn_job(worker, args, 1, "launch_bound")
        q1, q2, q3 = paired_ratio(blocks["hetrain"], blocks["torch"])
        medians.append(q2)
        rows.append(f"| {k + 1} | {samples / statistics.median(blocks['hetrain']):.1f} | "
                    f"{samples / statistics.median(blocks['torch']):.1f} | {q2:.3f} ({q1:.3f}-{q3:.3f}) |")
        print(rows[-1], flush=True)
    rows.append(f"| all | | | {statistics.median(medians):.3f} (repeats {min(medians):.3f}-{max(medians):.3f}) |")
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        where = (torch.cuda.get_device_name(0) + f", CUDA {torch.version.cuda}" if args.device == "cuda"
                 else f"the CPU ({os.cpu_count()} cores, one torch thread)")
        config = ", ".join(f"{k}={v}" for k, v in args.config.items())
        notes = (f"{args.model} ({config}), one stage of {num_layers(args.model, **args.config)} layers on {where}, "
                 f"torch {torch.__version__}; global batch {args.global_batch} in {args.micro_batches} micro-batches, "
                 f"fp32, SGD, the batch on the device for both. Per repeat (a fresh process) {args.warmup} warm-up "
                 f"steps per runtime, then {args.blocks} blocks of {args.block_steps} steps, taking turns (ABBA).")
        title = f"Launch-bound pipeline stage, {'GPU' if args.device == 'cuda' else 'CPU'} (issue 19)"
        write_section(title, "python benchmarks/launch_bound.py " + " ".join(sys.argv[1:]), table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
