"""What a run reports: the measured Timeline, metrics as JSONL, TensorBoard scalars, a progress bar.

The measured timeline is one iteration, recorded on every rank after a
barrier (so all clocks start together, as the simulator's do) and merged on the
reporting rank into ``hetrain.timeline``'s format, so that
``compare(simulate(plan).timeline, measured)`` lines them up::

    device tracks   forward "0F1", backward "0B1", recv "RECV_F 0->1 mb0 from n0:0",
                    send (posting, and waiting for sends before STEP), sync "ALLREDUCE seg0",
                    optimizer "STEP"
    link tracks     send_f / send_b from the sender's post to the receiver's arrival,
                    named as the simulator names them ("n0:0->n0:1", "n1 NIC out")

A metrics line per step::

    {"step": 3, "loss": 4.21, "samples_per_s": 812.5, "step_time_s": 0.0394, "elapsed_s": 0.21, "lr": 0.001}

(with ``"grad_norm"``, the global gradient norm before clipping, when the run clips; and
``"plan_fingerprint"``, ``hetrain.plan.plan_fingerprint`` of the plan trained, when the log is given it, so
that ``hetrain calibrate`` can refuse metrics of another plan),

and, with a validation set (``Trainer.fit(..., eval_every=N)``), a line per evaluation::

    {"step": 10, "val_loss": 3.02, "elapsed_s": 1.9, "eval_s": 0.31, "val_samples": 256}
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hetrain.cluster import Cluster
from hetrain.plan import PLAN_FINGERPRINT_KEY
from hetrain.timeline import Event, Timeline


class Recorder:
    """Timed events of one rank during the recorded iteration; does nothing while inactive.

    On a GPU (``cuda`` given) the host only queues kernels, so a host clock read
    after an action would time its launch, not its run: every reading first
    waits for the queued work. This costs the recorded iteration the overlap of
    launching with running: little for large kernels (gpt2-small on an H100:
    within 1% of its median step), much for many small ones (the mlp: 27%
    slower); samples/s come from the other, unsynchronised iterations. The
    GPU's peak allocated bytes over the recorded iteration
    are kept too (``peak_memory``), which the samples after each action miss.
    """

    def __init__(self, device: str, cuda: torch.device | None = None) -> None:
        self.device = device
        self.cuda = cuda
        self.active = False
        self.t0 = 0.0
        self.events: list[Event] = []
        self.sent: list[tuple[str, str, int, float, str]] = []  # (kind, receiver, i, posted at, label)
        self.received: list[tuple[str, str, int, float]] = []  # (kind, sender, i, arrived at)
        self.memory: list[tuple[float, float]] = []

    def start(self) -> None:
        """Start recording; time 0 is now."""
        self.active = True
        self.events, self.sent, self.received, self.memory = [], [], [], []
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        """Stop, and return this rank's part of the timeline (picklable)."""
        self.active = False
        peak = float(torch.cuda.max_memory_allocated(self.cuda)) if self.cuda is not None else None
        return {"device": self.device, "events": [tuple(e) for e in self.events], "sent": self.sent,
                "received": self.received, "memory": self.memory, "peak_memory": peak}

    def now(self) -> float:
        """Seconds since ``start``, once the device has run what was queued."""
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        return time.perf_counter() - self.t0


def _link_tracks(cluster: Cluster, src: str, dst: str) -> list[str]:
    """The simulator's names of the link resources a transfer from ``src`` to ``dst`` uses."""
    node_of = {d.name: d.node for d in cluster.devices}
    a, b = node_of.get(src), node_of.get(dst)
    if a == b:
        return [f"{src}->{dst}"]
    return [f"{a} NIC out", f"{b} NIC in"]


def merge_timeline(parts: Sequence[Mapping[str, Any]], cluster: Cluster, meta: Mapping[str, Any]) -> Timeline:
    """One measured Timeline from every used rank's part (``Recorder.stop``).

    A transfer becomes a link event from the sender's post to the receiver's arrival.
    """
    devices: dict[str, list[Event]] = {}
    memory: dict[str, list[tuple[float, float]]] = {}
    arrivals: dict[tuple[str, str, str, int], float] = {}
    peaks: dict[str, float] = {}
    for part in parts:
        devices[part["device"]] = sorted((Event(*e) for e in part["events"]), key=lambda e: e.start_s)
        if part.get("peak_memory") is not None:
            peaks[part["device"]] = part["peak_memory"]
        if part["memory"]:
            memory[part["device"]] = list(part["memory"])
        for kind, sender, i, t in part["received"]:
            arrivals[(kind, sender, part["device"], i)] = t
    links: dict[str, list[Event]] = {}
    for part in parts:
        for kind, receiver, i, posted, label in part["sent"]:
            arrived = arrivals.get((kind, part["device"], receiver, i))
            if arrived is None:
                continue
            for track in _link_tracks(cluster, part["device"], receiver):
                links.setdefault(track, []).append(Event(posted, max(posted, arrived), kind, label, i))
    for evs in links.values():
        evs.sort(key=lambda e: e.start_s)
    full_meta = {**meta, "peak_memory_bytes": peaks} if peaks else dict(meta)
    return Timeline(devices=devices, links=links, memory=memory, source="measured", meta=full_meta)


class MetricsLog:
    """Per-step metrics of the reporting rank: a JSONL file, TensorBoard scalars, a rich progress bar.

    Args:
        path: JSONL file (appended to: a resumed run continues it), or None.
        tensorboard_dir: where to write TensorBoard scalars, if tensorboard is installed; None for none.
        progress: draw a progress bar: True, False, or None for "when stdout is a terminal".
        total_steps: the step count the run goes to.
        start_step: the step it starts from (after a resume).
        plan_fingerprint: ``plan_fingerprint(plan)`` of the plan trained, written into every JSONL row
            (``PLAN_FINGERPRINT_KEY``); None writes none.
    """

    def __init__(self, path: str | Path | None, tensorboard_dir: str | Path | None, progress: bool | None,
                 total_steps: int, start_step: int, plan_fingerprint: str | None = None) -> None:
        self.plan_fingerprint = plan_fingerprint
        self.file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.writer: Any = None
        if tensorboard_dir is not None:
            with contextlib.suppress(ImportError, ModuleNotFoundError):
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(tensorboard_dir))
        self.progress: Any = None
        self.task: Any = None
        if progress if progress is not None else sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def log(self, record: Mapping[str, Any]) -> None:
        """Write one step's record (``step``, ``loss``, ``samples_per_s``, ``step_time_s``...)."""
        if self.file is not None:
            row = dict(record)
            if self.plan_fingerprint is not None:
                row[PLAN_FINGERPRINT_KEY] = self.plan_fingerprint
            self.file.write(json.dumps(row) + "\n")
        if self.writer is not None:
            section = "val" if "val_loss" in record else "train"
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{section}/{key}", value, int(record["step"]))
        if self.progress is not None and "loss" in record:  # not a validation record
            status = f"loss {record['loss']:.4f}  {record['samples_per_s']:.1f} samples/s"
            self.progress.update(self.task, completed=int(record["step"]), status=status)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.file is not None:
            self.file.close()
            self.file = None
