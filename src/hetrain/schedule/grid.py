"""The step-by-device text grid of a schedule, and the error that shows it with ``<-- ERROR HERE``.

Example (1F1B, p = 2 stages, m = 3 micro-batches; ``hetrain.schedule`` shows more)::

    step | n0:0                      | n0:1
    -----+---------------------------+---------------------------
       0 | 0F0                       | RECV_F 0->1 mb0 from n0:0
       1 | SEND_F 0->1 mb0 to n0:1   | 1F0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetrain.schedule.actions import Action, ScheduleError
from hetrain.schedule.roles import StageRole

ERROR_MARK = "<-- ERROR HERE"


def format_grid(schedule: Mapping[str, Sequence[Action]], devices: Sequence[str] | None = None,
                steps: range | None = None, marks: Mapping[tuple[str, int], str] | None = None) -> str:
    """A step-by-device table of the schedule: columns are devices, rows steps.

    Args:
        schedule: the schedule.
        devices: the columns (default: every device, in schedule order).
        steps: the rows (default: all).
        marks: text appended to cells, keyed by (device, step), e.g. ``ERROR_MARK``.
    """
    cols = list(schedule) if devices is None else list(devices)
    depth = max((len(schedule[d]) for d in cols), default=0)
    rows = range(depth) if steps is None else steps
    marks = marks or {}

    def cell(dev: str, k: int) -> str:
        actions = schedule[dev]
        text = str(actions[k]) if 0 <= k < len(actions) else ""
        if (dev, k) in marks:
            text = f"{text}  {marks[(dev, k)]}" if text else marks[(dev, k)]
        return text

    table = [[cell(d, k) for d in cols] for k in rows]
    widths = [max([len(d), *(len(r[c]) for r in table)]) for c, d in enumerate(cols)]
    step_w = max(4, len(str(max(rows, default=0))))
    lines = [(f"{'step':>{step_w}} | " + " | ".join(d.ljust(w) for d, w in zip(cols, widths, strict=True))).rstrip(),
             "-" * (step_w + 1) + "+" + "+".join("-" * (w + 2) for w in widths)]
    if len(rows) and rows[0] > 0:
        lines.append(f"{'...':>{step_w}} |")
    for k, r in zip(rows, table, strict=True):
        lines.append(f"{k:>{step_w}} | " + " | ".join(t.ljust(w) for t, w in zip(r, widths, strict=True)).rstrip())
    if len(rows) and rows[-1] < depth - 1:
        lines.append(f"{'...':>{step_w}} |")
    return "\n".join(lines)


_MAX_GRID_COLUMNS = 8
_MAX_GRID_ROWS = 40


def schedule_error(schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, StageRole], device: str | None,
                   step: int | None, message: str, also: Mapping[tuple[str, int], str] | None = None) -> ScheduleError:
    """A ScheduleError whose message is ``message`` above the grid, the failing cell marked."""
    marks = dict(also or {})
    if device is not None and step is not None:
        marks[(device, step)] = ERROR_MARK
    cols = list(schedule)
    if len(cols) > _MAX_GRID_COLUMNS and device is not None and device in roles:
        # the failing device's VW around it, then the other devices the marks name
        vw_devs = [d for d in roles[device].vw_devices if d in schedule]
        k = vw_devs.index(device) if device in vw_devs else 0
        lo = max(0, min(k - _MAX_GRID_COLUMNS // 2, len(vw_devs) - _MAX_GRID_COLUMNS))
        cols = vw_devs[lo:lo + _MAX_GRID_COLUMNS]
        cols += [d for d, _ in marks if d not in cols and d in schedule][:max(0, _MAX_GRID_COLUMNS - len(cols))]
    elif len(cols) > _MAX_GRID_COLUMNS:
        keep = cols[:_MAX_GRID_COLUMNS]
        if device is not None and device in schedule and device not in keep:
            keep[-1] = device  # the failing device always gets a column
        cols = keep
    depth = max((len(schedule[d]) for d in cols), default=0)
    rows = range(depth)
    if depth > _MAX_GRID_ROWS and step is not None:
        lo = max(0, min(step - _MAX_GRID_ROWS + 6, depth - _MAX_GRID_ROWS))
        rows = range(lo, lo + _MAX_GRID_ROWS)
    shown = f" ({len(cols)} of {len(schedule)} devices)" if len(cols) < len(schedule) else ""
    where = f"{device} step {step}: " if device is not None and step is not None else ""
    grid = format_grid(schedule, cols, rows, marks) if cols else "(empty schedule)"
    return ScheduleError(f"invalid schedule: {where}{message}\n\nschedule{shown}:\n{grid}")
