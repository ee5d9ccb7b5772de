"""The simulated iteration: per-device figures, the timeline, and the summary table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from hetrain.cost import estimate_device_memory
from hetrain.simulator.compile import Program
from hetrain.simulator.engine import Replayed
from hetrain.timeline import Timeline
from hetrain.units import format_bytes, format_time

_bytes = itemgetter(1)  # of a memory step (time_s, bytes)


@dataclass(frozen=True)
class DeviceStats:
    """What one device did during the simulated iteration.

    ``busy_s`` is compute (forward, backward, optimizer step), ``sync_s`` time in
    all-reduces, ``bubble_s`` the rest of the iteration: waiting for data, for
    the other owners of a segment, or for the slowest device to finish.
    """

    device: str
    vw: int
    stage: int
    iteration_s: float
    busy_s: float
    sync_s: float
    bubble_s: float
    peak_memory_bytes: float
    capacity_bytes: float
    max_in_flight: int

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def sync_fraction(self) -> float:
        return self.sync_s / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.iteration_s if self.iteration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "vw": self.vw, "stage": self.stage,
            "busy_fraction": self.busy_fraction, "sync_fraction": self.sync_fraction,
            "bubble_fraction": self.bubble_fraction, "busy_s": self.busy_s, "sync_s": self.sync_s,
            "bubble_s": self.bubble_s, "peak_memory_bytes": self.peak_memory_bytes,
            "capacity_bytes": self.capacity_bytes, "max_in_flight": self.max_in_flight,
        }


@dataclass(frozen=True)
class SimResult:
    """The simulated iteration.

    Attributes:
        timeline: events per device and per link, memory per device over time.
        iteration_s: from start to the last device's end (its optimizer step).
        pipeline_s: from start to the end of the last backward on any device.
        samples_per_s: global batch / iteration_s.
        devices: per device: busy, sync and bubble time, peak memory, activations in flight.
        closed_form_iteration_s: the plan's own prediction (``Plan.prediction.iteration_s``).
    """

    timeline: Timeline
    iteration_s: float
    pipeline_s: float
    samples_per_s: float
    devices: Mapping[str, DeviceStats]
    closed_form_iteration_s: float = 0.0

    def memory_curve(self, device: str) -> list[tuple[float, float]]:
        """``[(time_s, bytes), ...]`` of ``device``: a step function over the iteration."""
        return self.timeline.memory[device]

    def to_dict(self) -> dict[str, Any]:
        """Metrics as JSON (the timeline is written separately, it can be large)."""
        return {
            "iteration_s": self.iteration_s,
            "pipeline_s": self.pipeline_s,
            "samples_per_s": self.samples_per_s,
            "closed_form_iteration_s": self.closed_form_iteration_s,
            "devices": [s.to_dict() for s in self.devices.values()],
        }

    def summary(self, max_rows: int = 64) -> str:
        """Iteration time, throughput, and a per-device table."""
        cf = (f"; closed form {format_time(self.closed_form_iteration_s)}"
              if self.closed_form_iteration_s > 0 else "")
        lines = [
            f"simulated iteration {format_time(self.iteration_s)} (pipeline {format_time(self.pipeline_s)}), "
            f"{self.samples_per_s:.1f} samples/s{cf}",
            f"  {'device':<14} {'VW':>4} {'stage':>5} {'busy':>6} {'sync':>6} {'bubble':>6} "
            f"{'peak memory':>11} / {'capacity':<9} {'in flight':>9}",
        ]
        for s in list(self.devices.values())[:max_rows]:
            over = "  OVER" if s.peak_memory_bytes > s.capacity_bytes else ""
            lines.append(
                f"  {s.device:<14} {s.vw:>4} {s.stage:>5} {100 * s.busy_fraction:>5.1f}% "
                f"{100 * s.sync_fraction:>5.1f}% {100 * s.bubble_fraction:>5.1f}% "
                f"{format_bytes(s.peak_memory_bytes):>11} / {format_bytes(s.capacity_bytes):<9} "
                f"{s.max_in_flight:>9}{over}"
            )
        if len(self.devices) > max_rows:
            lines.append(f"  ... {len(self.devices) - max_rows} more devices (--json lists all)")
        return "\n".join(lines)


def build_result(program: Program, replayed: Replayed) -> SimResult:
    """The per-iteration result of a replay of ``program.iterations`` iterations."""
    plan, names, iterations = program.plan, program.names, program.iterations
    curves = replayed.memory
    total_s = max(replayed.finish_s, default=0.0)
    iteration_s = total_s / iterations
    timeline = Timeline(
        devices={name: replayed.events[d] for d, name in enumerate(names)},
        links={name: evs for name, evs in zip(program.links.names, program.links.events, strict=True) if evs},
        memory={name: curves[d] for d, name in enumerate(names)},
        source="simulated",
        meta={"model": plan.model, "cluster": plan.cluster.name, "schedule": plan.schedule, "sync": plan.sync,
              "iteration_s": iteration_s, "iterations": iterations},
    )
    devices = {dev.name: dev for dev in plan.cluster.devices}
    stats = {}
    for d, name in enumerate(names):
        v, j = program.where[d]
        busy, sync = replayed.busy_s[d], replayed.sync_s[d]
        stats[name] = DeviceStats(
            device=name, vw=v, stage=j, iteration_s=iteration_s, busy_s=busy / iterations,
            sync_s=sync / iterations, bubble_s=max(0.0, iteration_s - (busy + sync) / iterations),
            # the tensors' peak, with the runtime's footprint (cost.estimate_device_memory)
            peak_memory_bytes=estimate_device_memory(plan.profile, devices[name], max(curves[d], key=_bytes)[1]),
            capacity_bytes=devices[name].memory_bytes, max_in_flight=replayed.max_in_flight[d],
        )
    samples_per_s = plan.global_batch / iteration_s if iteration_s > 0 else 0.0
    if not plan.sync_mode.synchronous and iteration_s > 0:
        # VWs that run ahead finish their iterations sooner: each VW's own pace counts
        samples_per_s = 0.0
        for v, vw in enumerate(plan.virtual_workers):
            end = max(replayed.finish_s[d] for d in range(len(names)) if program.where[d][0] == v)
            samples_per_s += vw.mini_batch * iterations / end if end > 0 else 0.0
        iteration_s = plan.global_batch / samples_per_s
    return SimResult(
        timeline=timeline, iteration_s=iteration_s, pipeline_s=replayed.last_backward_s / iterations,
        samples_per_s=samples_per_s, devices=stats, closed_form_iteration_s=plan.prediction.iteration_s,
    )
