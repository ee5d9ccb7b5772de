"""Timelines: timed events per device and per link, predicted or measured.

The simulator predicts a Timeline, the runtime will record one, in the same
format, so the two can be laid side by side (``compare``). A timeline has one
track per device (what the device does: compute, waiting for data, syncing)
and one per link resource (what travels over it), plus each device's memory
over time::

    n0:0        |0F0|0F1|   .recv.   |0B0|0F2|  ...          device tracks
    n0:1        .recv.|1F0|1B0|1F1|1B1| ...
    n0:0->n0:1      |SEND_F mb0|                             link tracks
    fast NIC out        |SEND_F mb1|

Device event kinds: ``forward``, ``backward``, ``optimizer`` (compute),
``recv`` (held by a receive until its data arrives), ``send`` (held by a
blocking send, sync option ``transfers=blocking``), ``sync`` (in an
all-reduce); gaps are idle. Link event kinds: ``send_f`` (activations),
``send_b`` (gradients), ``allreduce``.

JSON form (``Timeline.to_dict``)::

    {"format_version": 1, "source": "simulated", "meta": {...},
     "event_fields": ["start_s", "end_s", "kind", "label", "micro_batch"],
     "devices": {"n0:0": [[0.0, 0.012, "forward", "0F0", 0], ...]},
     "links":   {"n0:0->n0:1": [[0.012, 0.013, "send_f", "SEND_F 0->1 mb0 n0:0->n0:1", 0], ...]},
     "memory":  {"n0:0": [[0.0, 1.2e9], [0.012, 1.5e9], ...]}}

A timeline may hold several iterations: ``meta["iterations"]`` (default 1). ``simulate`` replays
one for ``bsp`` and a cycle of them for the relaxed modes (``simulated_iterations``: 12 or more);
the runtime records one step. ``compare`` divides each side by its own count, so it lays one
iteration beside one step whatever the mode.

Example:
    >>> result = simulate(plan)                                 # doctest: +SKIP
    >>> result.timeline.to_chrome_trace("trace.json")           # doctest: +SKIP
    >>> result.timeline.save_gantt("gantt.png")                 # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hetrain.errors import InputError
from hetrain.fields import load_json_object

FORMAT_VERSION = 1
EVENT_FIELDS = ("start_s", "end_s", "kind", "label", "micro_batch")
COMPUTE_KINDS = ("forward", "backward", "optimizer")
#: fill colours of the Gantt picture, by event kind
KIND_COLORS: dict[str, str] = {
    "forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2", "recv": "#dddddd", "send": "#bbbbbb",
    "sync": "#c44e52", "send_f": "#64b5cd", "send_b": "#8dd3a0", "allreduce": "#e8a0a2",
}


class TimelineError(InputError):
    """A timeline file that cannot be read."""


class Event(NamedTuple):
    """One interval on a track: ``[start_s, end_s)``, what it is, and which action made it."""

    start_s: float
    end_s: float
    kind: str
    label: str
    micro_batch: int | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    """Timed events per device and per link, and memory per device over time.

    Attributes:
        devices: device name -> its events, in time order, never overlapping.
        links: link track name -> transfers over it (``"n0:0->n0:1"``, ``"fast NIC out"``).
        memory: device name -> ``[(time_s, bytes), ...]``, a step function.
        source: ``"simulated"`` or ``"measured"``.
        meta: free-form facts (plan, schedule, iteration time...).
    """

    devices: dict[str, list[Event]] = field(default_factory=dict)
    links: dict[str, list[Event]] = field(default_factory=dict)
    memory: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    source: str = "simulated"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def iterations(self) -> int:
        """How many iterations the timeline holds (``meta["iterations"]``; 1 where it does not say)."""
        return int(self.meta.get("iterations", 1))

    @property
    def span_s(self) -> float:
        """From 0 to the end of the last event on any track."""
        return max((e.end_s for evs in (*self.devices.values(), *self.links.values()) for e in evs), default=0.0)

    def time_in(self, device: str, kinds: tuple[str, ...]) -> float:
        """Seconds ``device`` spends in events of these kinds."""
        return sum(e.end_s - e.start_s for e in self.devices.get(device, ()) if e.kind in kinds)

    def idle_intervals(self, device: str, until_s: float | None = None) -> list[tuple[float, float]]:
        """Gaps between the device's events, from 0 to ``until_s`` (default: the span)."""
        end = self.span_s if until_s is None else until_s
        out = []
        t = 0.0
        for e in sorted(self.devices.get(device, ()), key=lambda e: e.start_s):
            if e.start_s > t:
                out.append((t, e.start_s))
            t = max(t, e.end_s)
        if end > t:
            out.append((t, end))
        return out

    # --- JSON ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Compact JSON form: each event a list in ``EVENT_FIELDS`` order."""
        return {
            "format_version": FORMAT_VERSION,
            "source": self.source,
            "meta": self.meta,
            "event_fields": list(EVENT_FIELDS),
            "devices": {d: [list(e) for e in evs] for d, evs in self.devices.items()},
            "links": {d: [list(e) for e in evs] for d, evs in self.links.items()},
            "memory": {d: [list(p) for p in pts] for d, pts in self.memory.items()},
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Timeline:
        return parse_timeline(data)

    def save(self, path: str | Path) -> None:
        """Write the timeline as JSON."""
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    # --- pictures -----------------------------------------------------------

    def to_chrome_trace(self, path: str | Path) -> None:
        """Write a Chrome trace (opens in ui.perfetto.dev or chrome://tracing).

        Process 1 holds one thread (track) per device, process 2 one per link;
        memory per device is a counter track. Times are in microseconds.
        """
        out: list[dict[str, Any]] = [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"devices ({self.source})"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "links"}},
        ]
        for pid, tracks in ((1, self.devices), (2, self.links)):
            for tid, (name, events) in enumerate(tracks.items(), start=1):
                out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
                out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                            "args": {"sort_index": tid}})
                for e in events:
                    args: dict[str, Any] = {"kind": e.kind}
                    if e.micro_batch is not None:
                        args["micro_batch"] = e.micro_batch
                    out.append({"ph": "X", "pid": pid, "tid": tid, "name": e.label, "cat": e.kind,
                                "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "args": args})
        for name, points in self.memory.items():
            for t, b in points:
                out.append({"ph": "C", "pid": 1, "name": f"memory {name}", "ts": t * 1e6, "args": {"GB": b / 1e9}})
        Path(path).write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}) + "\n")

    def save_gantt(self, path: str | Path, title: str | None = None, max_devices: int = 32,
                   max_links: int = 16) -> None:
        """Draw the timeline as a Gantt chart (PNG): a row per device, then a row per link.

        Forward and backward bars carry their micro-batch number where they are
        wide enough. Large timelines show the first ``max_devices`` devices and
        the busiest ``max_links`` links.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        devices = list(self.devices)[:max_devices]
        busy = sorted(self.links, key=lambda n: -sum(e.end_s - e.start_s for e in self.links[n]))
        links = [n for n in self.links if n in set(busy[:max_links])]
        rows = [(n, self.devices[n]) for n in devices] + [(n, self.links[n]) for n in links]
        span = self.span_s or 1.0
        scale, unit = (1e3, "ms") if span < 1 else (1.0, "s")
        fig_h = 1.2 + 0.32 * max(1, len(rows))
        fig, ax = plt.subplots(figsize=(14, fig_h))
        seen_kinds: list[str] = []
        for r, (_, events) in enumerate(rows):
            by_kind: dict[str, list[tuple[float, float]]] = {}
            for e in events:
                by_kind.setdefault(e.kind, []).append((e.start_s * scale, (e.end_s - e.start_s) * scale))
                if e.kind in ("forward", "backward") and e.micro_batch is not None and \
                        (e.end_s - e.start_s) > span / 90:
                    ax.text((e.start_s + e.end_s) / 2 * scale, r, str(e.micro_batch), ha="center",
                            va="center", fontsize=7, color="white")
            for kind, bars in by_kind.items():
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=KIND_COLORS.get(kind, "#999999"),
                               edgecolor="white", linewidth=0.3)
                if kind not in seen_kinds:
                    seen_kinds.append(kind)
        if devices and links:
            ax.axhline(len(devices) - 0.5, color="black", linewidth=0.8)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([n for n, _ in rows], fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0, span * scale * 1.01)
        ax.set_xlabel(f"time ({unit})")
        ax.grid(axis="x", linewidth=0.3, alpha=0.5)
        cut = [f"{len(drawn)} of {len(every)} {what}" for drawn, every, what in
               ((devices, self.devices, "devices"), (links, self.links, "links")) if len(drawn) < len(every)]
        shown = f"  (showing {', '.join(cut)})" if cut else ""
        ax.set_title((title or f"{self.source} timeline") + shown, fontsize=10)
        ax.legend(handles=[Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in seen_kinds],
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(str(path), dpi=110)
        plt.close(fig)


#: how to write a timeline, for the messages that refuse another file
HOW_TO_WRITE = "write one with `hetrain simulate PLAN --timeline FILE` or `hetrain train ... --timeline-out FILE`"


def _other_kind(data: Mapping[str, Any]) -> str | None:
    """What another hetrain file that is not a timeline is (``"a plan"``, ``"a profile"``), or None."""
    if "virtual_workers" in data and "cluster" in data:
        return "a plan"
    if "layers" in data and "devices" not in data:
        return "a profile"
    return None


def parse_timeline(data: Mapping[str, Any]) -> Timeline:
    """Build a Timeline from its JSON dict."""
    if isinstance(data, Mapping) and (kind := _other_kind(data)) is not None:
        raise TimelineError(f"got {kind}, not a timeline ({HOW_TO_WRITE})")
    version = data.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise TimelineError(f"timeline format_version {version} is not supported (this hetrain reads {FORMAT_VERSION})")

    def events(raw: Any, where: str) -> list[Event]:
        try:
            return [Event(float(e[0]), float(e[1]), str(e[2]), str(e[3]), None if e[4] is None else int(e[4]))
                    for e in raw]
        except (IndexError, TypeError, ValueError) as err:
            raise TimelineError(f"{where}: an event is [start_s, end_s, kind, label, micro_batch] ({err})") from None

    if not isinstance(data, Mapping):
        raise TimelineError(f"a timeline is a JSON object with devices, links and memory, got {type(data).__name__}")
    for key in ("devices", "links", "memory", "meta"):
        if not isinstance(data.get(key, {}), Mapping):
            hint = (": this looks like the metrics of `hetrain simulate --json`; write the predicted timeline "
                    "with `hetrain simulate PLAN --timeline FILE`" if "iteration_s" in data else "")
            raise TimelineError(f"timeline {key!r} must map names to lists, got a {type(data[key]).__name__}{hint}")
    iterations = data.get("meta", {}).get("iterations", 1)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise TimelineError(f"timeline meta 'iterations' must be a whole number >= 1 (the iterations it holds), "
                            f"got {json.dumps(iterations, default=str)}")
    return Timeline(
        devices={str(d): events(evs, f"device {d}") for d, evs in data.get("devices", {}).items()},
        links={str(d): events(evs, f"link {d}") for d, evs in data.get("links", {}).items()},
        memory={str(d): [(float(t), float(b)) for t, b in pts] for d, pts in data.get("memory", {}).items()},
        source=str(data.get("source", "simulated")),
        meta=dict(data.get("meta", {})),
    )


def load_timeline(path: str | Path) -> Timeline:
    """Read a timeline JSON file."""
    p = Path(path)
    data = load_json_object(p, TimelineError, "timeline")
    if (kind := _other_kind(data)) is not None:
        raise TimelineError(f"{p} is {kind}, not a timeline ({HOW_TO_WRITE})")
    try:
        return parse_timeline(data)
    except TimelineError as e:
        raise TimelineError(f"{p}: {e}") from None


def load_comparison(predicted_path: str | Path, measured_path: str | Path) -> tuple[Timeline, Timeline]:
    """The two timelines ``hetrain compare`` lays side by side, predicted first.

    Each timeline records its ``source``; a measured one given first and a simulated one second (the
    arguments swapped) would report every error inverted, so it is refused naming both files.

    Raises:
        TimelineError: a file that is not a timeline, or the two in the wrong order.
    """
    predicted, measured = load_timeline(predicted_path), load_timeline(measured_path)
    if predicted.source == "measured" and measured.source == "simulated":
        raise TimelineError(f"{predicted_path} is a measured timeline and {measured_path} a simulated one: the "
                            f"predicted one comes first (hetrain compare {measured_path} {predicted_path})")
    return predicted, measured


# ---------------------------------------------------------------------------
# predicted vs measured
# ---------------------------------------------------------------------------


class KindError(NamedTuple):
    """Predicted and measured time of one device in one kind of event, per iteration.

    Counts and seconds are each timeline's totals divided by its iterations (``Timeline.iterations``),
    so a count may be fractional: DASO's 16 sync events over 12 simulated iterations are 1.33.
    """

    device: str
    kind: str
    predicted_count: float
    measured_count: float
    predicted_s: float
    measured_s: float

    @property
    def relative_error(self) -> float:
        """``(predicted - measured) / measured`` of the time per iteration; nan when nothing was measured."""
        if self.measured_s == 0:
            return 0.0 if self.predicted_s == 0 else math.nan
        return (self.predicted_s - self.measured_s) / self.measured_s


class MemoryPeak(NamedTuple):
    """Predicted and measured peak memory of one device over the iteration."""

    device: str
    predicted_bytes: float
    measured_bytes: float

    @property
    def relative_error(self) -> float:
        """``(predicted - measured) / measured``; nan when nothing was measured."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes if self.measured_bytes else math.nan


#: why the two sides' counts of ``sync`` events differ (``Comparison.__str__`` prints it where they do)
SYNC_COUNT_NOTE = ("n sync: the simulator counts only the waits that hold a device (a post costs it no time), "
                   "the runtime each post and each wait: compare the times, not the counts")


def _count(n: float) -> str:
    """A count per iteration: ``4``, ``1.33``."""
    return f"{n:g}" if float(n).is_integer() else f"{n:.2f}"


def _per(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Comparison:
    """Per device and event kind: predicted vs measured time per iteration, and peak memory where measured.

    ``str()`` prints the tables, under a line that says what each side was divided by.

    Attributes:
        rows: per device and kind; counts and seconds per iteration.
        memory: peak memory per device, where both sides have it.
        predicted_iterations: the iterations the predicted timeline holds (``simulated_iterations``).
        measured_iterations: the iterations (steps) the measured timeline holds.
    """

    rows: tuple[KindError, ...]
    memory: tuple[MemoryPeak, ...] = ()
    predicted_iterations: int = 1
    measured_iterations: int = 1

    def worst(self) -> KindError | None:
        """The row with the largest absolute relative error."""
        finite = [r for r in self.rows if not math.isnan(r.relative_error)]
        return max(finite, key=lambda r: abs(r.relative_error), default=None)

    def header(self) -> str:
        """``per iteration: predicted totals / 12 simulated iterations, measured totals / 1 recorded step``."""
        return (f"per iteration: predicted totals / {_per(self.predicted_iterations, 'simulated iteration')}, "
                f"measured totals / {_per(self.measured_iterations, 'recorded step')}")

    def __str__(self) -> str:
        lines = [self.header(),
                 f"{'device':<14} {'kind':<10} {'n pred':>6} {'n meas':>6} {'predicted':>12} "
                 f"{'measured':>12} {'error':>8}"]
        for r in self.rows:
            err = "n/a" if math.isnan(r.relative_error) else f"{100 * r.relative_error:+.1f}%"
            lines.append(f"{r.device:<14} {r.kind:<10} {_count(r.predicted_count):>6} {_count(r.measured_count):>6} "
                         f"{r.predicted_s:>12.6f} {r.measured_s:>12.6f} {err:>8}")
        if any(r.kind == "sync" and r.predicted_count != r.measured_count for r in self.rows):
            lines.append(SYNC_COUNT_NOTE)
        if self.memory:
            lines.append(f"\n{'device':<14} {'peak memory':<10} {'':>6} {'':>6} {'predicted':>12} "
                         f"{'measured':>12} {'error':>8}")
            for m in self.memory:
                err = "n/a" if math.isnan(m.relative_error) else f"{100 * m.relative_error:+.1f}%"
                lines.append(f"{m.device:<14} {'':<10} {'':>6} {'':>6} {m.predicted_bytes / 1e6:>10.1f}MB "
                             f"{m.measured_bytes / 1e6:>10.1f}MB {err:>8}")
        return "\n".join(lines)


def _per_iteration(count: int, iterations: int) -> float:
    """``count`` events over ``iterations``: an int where it divides evenly (``4``), else a fraction (``1.33``)."""
    return count // iterations if count % iterations == 0 else count / iterations


def compare(predicted: Timeline, measured: Timeline) -> Comparison:
    """Per device and per event kind, the predicted and measured seconds per iteration and their error.

    Each side's event counts and total seconds are divided by the iterations it holds
    (``Timeline.iterations``): a relaxed sync mode's simulated timeline holds a cycle of 12 or more,
    a measured one the one recorded step. Each device also gets a row of kind ``iteration``: the end
    of its last event, divided likewise (its mean pace).
    Peak memory is compared where both timelines have it: the predicted memory
    track's maximum against the measured peak (``meta["peak_memory_bytes"]``,
    which the runtime reads on a GPU), else the measured track's maximum.

    Example:
        >>> print(compare(simulated, load_timeline("measured.json")))   # doctest: +SKIP
    """
    rows, memory = [], []
    n_pred, n_meas = predicted.iterations, measured.iterations
    peaks = measured.meta.get("peak_memory_bytes", {})
    for dev in [d for d in predicted.devices if d in measured.devices]:
        pe, me = predicted.devices[dev], measured.devices[dev]
        kinds = list(dict.fromkeys([e.kind for e in pe] + [e.kind for e in me]))
        for kind in kinds:
            p = [e for e in pe if e.kind == kind]
            m = [e for e in me if e.kind == kind]
            rows.append(KindError(dev, kind, _per_iteration(len(p), n_pred), _per_iteration(len(m), n_meas),
                                  sum(e.duration_s for e in p) / n_pred, sum(e.duration_s for e in m) / n_meas))
        rows.append(KindError(dev, "iteration", 1, 1, max((e.end_s for e in pe), default=0.0) / n_pred,
                              max((e.end_s for e in me), default=0.0) / n_meas))
        measured_peak = peaks.get(dev, max((b for _, b in measured.memory.get(dev, [])), default=None))
        predicted_peak = max((b for _, b in predicted.memory.get(dev, [])), default=None)
        if measured_peak is not None and predicted_peak is not None:
            memory.append(MemoryPeak(dev, float(predicted_peak), float(measured_peak)))
    return Comparison(tuple(rows), tuple(memory), n_pred, n_meas)


def save_side_by_side(predicted: Timeline, measured: Timeline, path: str | Path) -> None:
    """One PNG with the predicted Gantt chart above the measured one, on their own time axes."""
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        top, bottom = Path(tmp) / "predicted.png", Path(tmp) / "measured.png"
        predicted.save_gantt(top, title=f"predicted ({predicted.source})")
        measured.save_gantt(bottom, title=f"measured ({measured.source})")
        images = [mpimg.imread(top), mpimg.imread(bottom)]
    heights = [img.shape[0] for img in images]
    fig, axes = plt.subplots(2, 1, figsize=(14, sum(heights) / 100), gridspec_kw={"height_ratios": heights})
    for ax, img in zip(axes, images, strict=True):
        ax.imshow(img)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
