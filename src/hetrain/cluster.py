"""Devices, nodes and links of a cluster; the cluster file (TOML) and its validation.

A cluster file lists nodes; each node has devices, an intra-node link and a NIC::

    [[node]]
    name = "fast"
    devices = ["A100-40GB", "A100-40GB"]
    intra_link = "nvlink3"
    nic = "100Gbit/s"

    [[link]]                      # optional override between two nodes
    nodes = ["fast", "old"]
    bandwidth = "25Gbit/s"
    latency = "10us"

Between two nodes the link is the override if there is one, else the slower of
the two NICs (and the larger of their latencies). Devices are numbered in file
order (node by node); ``Device.name`` is ``"<node>:<k>"``. docs/cluster.md has
the full format.

Picture of the link lookup for devices ``a`` and ``b``::

    same node ──► node.intra_link
    else ───────► [[link]] override ── or ──► min(nic_a, nic_b) bandwidth, max latency

Example:
    >>> c = load_cluster("examples/clusters/hetpipe.toml")     # doctest: +SKIP
    >>> c.link(0, 5).bandwidth_bytes_per_s                      # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from hetrain.catalog import (
    DEFAULT_INTER_NODE_LATENCY_S,
    DEFAULT_INTRA_NODE_LATENCY_S,
    DeviceType,
    lookup_device_type,
    lookup_link_preset,
    peak_flops_for,
)
from hetrain.errors import InputError
from hetrain.fields import MAX_DEVICES, MAX_NODES, load_toml_object, show
from hetrain.units import UnitError, parse_bandwidth, parse_bytes, parse_time


class ClusterError(InputError):
    """A cluster description that cannot be used; the message names what and where."""


@dataclass(frozen=True)
class Link:
    """What joins two devices: per-direction bandwidth and one-way latency.

    ``latency_s`` is a point-to-point message's, as a ping-pong measures it: the
    endpoints' time to hand the message over and to wake for it is in it.
    ``collective_latency_s``, where known, is one step of a collective (a ring
    all-reduce's reduce-scatter or all-gather step), which the communication
    library runs in its own threads or kernels without waking the caller between
    steps; ``hetrain discover`` measures it with a two-rank all-reduce. Without it
    a collective's steps take ``latency_s`` (``step_latency_s``).
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    collective_latency_s: float | None = None

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ClusterError(f"link bandwidth must be positive, got {self.bandwidth_bytes_per_s}")
        if not self.latency_s >= 0:
            raise ClusterError(f"link latency must be >= 0, got {self.latency_s}")
        if self.collective_latency_s is not None and not self.collective_latency_s >= 0:
            raise ClusterError(f"link collective latency must be >= 0, got {self.collective_latency_s}")

    @property
    def step_latency_s(self) -> float:
        """The latency of one step of a collective over this link."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s

    def to_dict(self) -> dict[str, float]:
        out = {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}
        if self.collective_latency_s is not None:
            out["collective_latency_s"] = self.collective_latency_s
        return out


@dataclass(frozen=True)
class Device:
    """One accelerator (or, in emulation, one CPU process).

    Attributes:
        name: ``"<node>:<k>"``, unique in the cluster.
        node: name of the node that hosts it.
        index: position in the cluster's device order.
        type_name: device type, the key profiles use for measured times.
        peak_fp32_flops / peak_fp16_flops: dense peak rates, FLOP/s.
        memory_bytes: memory, bytes.
        memory_bandwidth_bytes_per_s: memory bandwidth, bytes/s.
        cpu_share: for emulation only: the CPU fraction its process gets (None: unthrottled).
        peak_bf16_flops: dense bf16 rate, FLOP/s, where it is not the fp16 rate (Volta and Turing
            have no bf16 tensor cores: ``catalog.DeviceType.peak_bf16_flops``); None: the fp16 rate.
        tp_group: in a cluster of TP groups (``tp_cluster``), the k devices this one leads, itself first; empty
            for a device on its own. Not part of a cluster file.
        tp_link: the link the group's collectives run on (its node's intra-node link); None alone.
    """

    name: str
    node: str
    index: int
    type_name: str
    peak_fp32_flops: float
    peak_fp16_flops: float
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    cpu_share: float | None = None
    peak_bf16_flops: float | None = None
    tp_group: tuple[str, ...] = ()
    tp_link: Link | None = None

    @property
    def tp(self) -> int:
        """The TP degree of the group this device stands for (1: itself alone)."""
        return len(self.tp_group) or 1

    def peak_flops(self, precision: str) -> float:
        """The peak rate for ``precision`` (``"fp32"``, ``"fp16"`` or ``"bf16"``), FLOP/s."""
        return peak_flops_for(precision, self.peak_fp32_flops, self.peak_fp16_flops, self.peak_bf16_flops)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type_name,
            "peak_fp32_flops": self.peak_fp32_flops,
            "peak_fp16_flops": self.peak_fp16_flops,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
        }
        if self.peak_bf16_flops is not None:
            out["peak_bf16_flops"] = self.peak_bf16_flops
        if self.cpu_share is not None:
            out["cpu_share"] = self.cpu_share
        return out


@dataclass(frozen=True)
class Node:
    """A host: devices that share ``intra_link``, reaching other nodes through ``nic``."""

    name: str
    devices: tuple[Device, ...]
    intra_link: Link
    nic: Link

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "devices": [d.to_dict() for d in self.devices],
            "intra_link": self.intra_link.to_dict(),
            "nic": self.nic.to_dict(),
        }


@dataclass(frozen=True)
class NodeLink:
    """An explicit link between two nodes, overriding the NIC default."""

    nodes: tuple[str, str]
    link: Link

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), **self.link.to_dict()}


@dataclass(frozen=True)
class Cluster:
    """Nodes, their devices, and every link between devices.

    ``bandwidth_bytes_per_s[a, b]`` and ``latency_s[a, b]`` are matrices over
    device indices, built once, so cost functions look links up in O(1).
    """

    name: str
    nodes: tuple[Node, ...]
    node_links: tuple[NodeLink, ...] = ()
    devices: tuple[Device, ...] = field(init=False, repr=False, compare=False)
    node_index: np.ndarray = field(init=False, repr=False, compare=False)
    bandwidth_bytes_per_s: np.ndarray = field(init=False, repr=False, compare=False)
    latency_s: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ClusterError(f"cluster {self.name!r} has no nodes; add at least one [[node]]")
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ClusterError(f"duplicate node names: {', '.join(dupes)}; node names must be unique")
        for n in self.nodes:
            if not n.devices:
                raise ClusterError(f"node {n.name!r} has no devices")
        devices = tuple(d for n in self.nodes for d in n.devices)
        for i, d in enumerate(devices):
            if d.index != i:
                raise ClusterError(f"device {d.name} has index {d.index}, expected {i}")
        by_name = {n.name: k for k, n in enumerate(self.nodes)}
        overrides: dict[tuple[int, int], Link] = {}
        for nl in self.node_links:
            for nn in nl.nodes:
                if nn not in by_name:
                    raise ClusterError(
                        f"[[link]] {list(nl.nodes)} names unknown node {nn!r}; nodes are: {', '.join(names)}"
                    )
            a, b = by_name[nl.nodes[0]], by_name[nl.nodes[1]]
            if a == b:
                raise ClusterError(f"[[link]] {list(nl.nodes)} joins a node to itself; use intra_link")
            overrides[(a, b)] = overrides[(b, a)] = nl.link
        node_index = np.array([by_name[d.node] for d in devices], dtype=np.int64)
        k = len(self.nodes)
        node_bw = np.zeros((k, k))
        node_lat = np.zeros((k, k))
        node_step = np.zeros((k, k))
        for a, na in enumerate(self.nodes):
            for b, nb in enumerate(self.nodes):
                if a == b:
                    link = na.intra_link
                elif (a, b) in overrides:
                    link = overrides[(a, b)]
                else:
                    collective = (None if na.nic.collective_latency_s is None and nb.nic.collective_latency_s is None
                                  else max(na.nic.step_latency_s, nb.nic.step_latency_s))
                    link = Link(min(na.nic.bandwidth_bytes_per_s, nb.nic.bandwidth_bytes_per_s),
                                max(na.nic.latency_s, nb.nic.latency_s), collective)
                node_bw[a, b] = link.bandwidth_bytes_per_s
                node_lat[a, b] = link.latency_s
                node_step[a, b] = np.nan if link.collective_latency_s is None else link.collective_latency_s
        bw = node_bw[np.ix_(node_index, node_index)]
        lat = node_lat[np.ix_(node_index, node_index)]
        np.fill_diagonal(bw, np.inf)  # a device to itself: free
        np.fill_diagonal(lat, 0.0)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "node_index", node_index)
        object.__setattr__(self, "bandwidth_bytes_per_s", bw)
        object.__setattr__(self, "latency_s", lat)
        object.__setattr__(self, "_node_bw", node_bw)
        object.__setattr__(self, "_node_lat", node_lat)
        object.__setattr__(self, "_node_step", node_step)

    # --- lookups -----------------------------------------------------------

    def link(self, a: int, b: int) -> Link:
        """The link between devices ``a`` and ``b`` (indices)."""
        if a == b:
            raise ClusterError(f"no link from device {self.devices[a].name} to itself")
        return Link(float(self.bandwidth_bytes_per_s[a, b]), float(self.latency_s[a, b]))

    def node_link(self, a: int, b: int) -> Link:
        """The link between nodes ``a`` and ``b`` (indices); the intra link when a == b."""
        nb: np.ndarray = self._node_bw  # type: ignore[attr-defined]
        nl: np.ndarray = self._node_lat  # type: ignore[attr-defined]
        ns: np.ndarray = self._node_step  # type: ignore[attr-defined]
        step = float(ns[a, b])
        return Link(float(nb[a, b]), float(nl[a, b]), None if np.isnan(step) else step)

    def ring_node_links(self, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, collective step latency) of each link of the ring of nodes ``order`` (node indices: each to
        the next, the last to the first), as ``node_link`` gives them: a ring of 512 nodes at once."""
        a = np.asarray(order, dtype=np.int64)
        b = np.roll(a, -1)
        nb: np.ndarray = self._node_bw  # type: ignore[attr-defined]
        nl: np.ndarray = self._node_lat  # type: ignore[attr-defined]
        step: np.ndarray = self._node_step[a, b]  # type: ignore[attr-defined]
        return nb[a, b], np.where(np.isnan(step), nl[a, b], step)

    def device(self, name: str) -> Device:
        """The device called ``name`` (``"node:k"``); ClusterError listing a few names if none."""
        for d in self.devices:
            if d.name == name:
                return d
        some = ", ".join(d.name for d in self.devices[:6])
        raise ClusterError(f"no device {name!r} in cluster {self.name!r}; devices are {some}, ...")

    def group_device(self, names: tuple[str, ...]) -> Device:
        """The device a TP group of ``names`` stands for in the cost model: its first, carrying the group and the
        link its collectives run on (its node's intra-node link). One name: that device as it is."""
        lead = self.device(names[0])
        if len(names) < 2:
            return lead
        node = next(n for n in self.nodes if n.name == lead.node)
        return replace(lead, tp_group=tuple(names), tp_link=node.intra_link)

    @property
    def type_names(self) -> list[str]:
        """The distinct device types, in the order of their first device."""
        return list(dict.fromkeys(d.type_name for d in self.devices))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def summary(self) -> str:
        """One line per node: devices by type, intra link, NIC."""
        from hetrain.units import format_bandwidth

        lines = [f"cluster {self.name}: {len(self.nodes)} nodes, {self.num_devices} devices"]
        for n in self.nodes:
            counts: dict[str, int] = {}
            for d in n.devices:
                counts[d.type_name] = counts.get(d.type_name, 0) + 1
            devs = ", ".join(f"{c}x {t}" for t, c in counts.items())
            lines.append(
                f"  {n.name:<12} {devs:<28} intra {format_bandwidth(n.intra_link.bandwidth_bytes_per_s):>12}"
                f"  nic {format_bandwidth(n.nic.bandwidth_bytes_per_s):>12}"
            )
        return "\n".join(lines)

    # --- (de)serialisation -------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain-SI dict that ``parse_cluster`` reads back (also valid as TOML)."""
        return {
            "name": self.name,
            "node": [n.to_dict() for n in self.nodes],
            "link": [nl.to_dict() for nl in self.node_links],
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Cluster:
        return parse_cluster(data)


# --- parsing -----------------------------------------------------------------

def _quantity(spec: Mapping[str, Any], human_key: str, si_key: str, parse: Any, where: str,
              required: bool = True) -> float | None:
    """Read ``spec[human_key]`` with units, or ``spec[si_key]`` as a plain SI number."""
    if si_key in spec:
        value = spec[si_key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ClusterError(f"{where}: {si_key} must be a finite number, got {show(value)}")
        out = float(value)
    elif human_key in spec:
        try:
            out = parse(spec[human_key], f"{where}: {human_key}")
        except UnitError as e:
            raise ClusterError(str(e)) from None
        if not math.isfinite(out):  # "1e400GB" parses to inf: a plan with it predicts inf margins
            raise ClusterError(f"{where}: {human_key} must be a finite quantity, got {show(spec[human_key])}")
    elif required:
        raise ClusterError(f"{where}: missing {human_key!r}")
    else:
        return None
    if not out > 0 and "latency" not in human_key:
        raise ClusterError(f"{where}: {human_key} must be positive, got {spec.get(human_key, out)!r}")
    if out < 0:
        raise ClusterError(f"{where}: {human_key} must be >= 0, got {spec.get(human_key, out)!r}")
    return out


def _parse_link(spec: Any, where: str, default_latency_s: float) -> Link:
    """A link: preset name, bandwidth string, or table {bandwidth, latency}."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        raise ClusterError(
            f"{where}: {spec!r} has no unit; write a bandwidth such as '10Gbit/s' or a preset such as '10gbe'"
        )
    if isinstance(spec, str):
        try:
            p = lookup_link_preset(spec)
            return Link(p.bandwidth_bytes_per_s, p.latency_s)
        except KeyError as preset_error:
            try:
                bw = parse_bandwidth(spec, where)
            except UnitError as unit_error:
                if spec.strip()[:1] in set("0123456789.+-"):  # meant as a bandwidth: say what is wrong with it
                    raise ClusterError(f"{unit_error}; or name a link preset such as '10gbe'") from None
                raise ClusterError(f"{where}: {preset_error.args[0]}; or give a bandwidth such as '10Gbit/s'") from None
            if not bw > 0:
                raise ClusterError(f"{where}: bandwidth must be positive, got {spec!r}") from None
            if not math.isfinite(bw):
                raise ClusterError(f"{where}: bandwidth must be finite, got {spec!r}") from None
            return Link(bw, default_latency_s)
    if isinstance(spec, Mapping):
        known = {"bandwidth", "latency", "bandwidth_bytes_per_s", "latency_s", "preset", "collective_latency",
                 "collective_latency_s"}
        extra = set(spec) - known
        if extra:
            raise ClusterError(f"{where}: unknown keys {sorted(extra)}; a link has {sorted(known)}")
        if "preset" in spec:
            if not isinstance(spec["preset"], str):
                raise ClusterError(f"{where}: preset must be a link preset name, got {show(spec['preset'])}")
            base = _parse_link(spec["preset"], where, default_latency_s)
            bw, lat = base.bandwidth_bytes_per_s, base.latency_s
        else:
            bw = _quantity(spec, "bandwidth", "bandwidth_bytes_per_s", parse_bandwidth, where)  # type: ignore[assignment]
            lat = default_latency_s
        if "bandwidth" in spec or "bandwidth_bytes_per_s" in spec:
            bw = _quantity(spec, "bandwidth", "bandwidth_bytes_per_s", parse_bandwidth, where)  # type: ignore[assignment]
        got_lat = _quantity(spec, "latency", "latency_s", parse_time, where, required=False)
        if got_lat is not None:
            lat = got_lat
        collective = _quantity(spec, "collective_latency", "collective_latency_s", parse_time, where, required=False)
        return Link(bw, lat, collective)
    raise ClusterError(f"{where}: a link is a preset name, a bandwidth string or a table, got {show(spec)}")


_DEVICE_KEYS = {
    "type", "count", "tflops", "tflops_fp16", "tflops_bf16", "memory", "memory_bandwidth", "cpu_share",
    "peak_fp32_flops", "peak_fp16_flops", "peak_bf16_flops", "memory_bytes", "memory_bandwidth_bytes_per_s",
}


#: placeholder figures for the fields a custom device's table lacks, in ``_custom_example``
_EXAMPLE_FIGURES = {"tflops": 10.0, "memory": "16GB", "memory_bandwidth": "500GB/s"}


def _custom_example(spec: Mapping[str, Any], missing: list[str]) -> str:
    """The user's device table as TOML, with placeholder figures for the ``missing`` fields.

    Example:
        >>> _custom_example({"type": "Foo", "tflops": 10, "memory": "8GB"}, ["memory_bandwidth"])
        '{ type = "Foo", tflops = 10, memory = "8GB", memory_bandwidth = "500GB/s" }'
    """
    def toml(value: Any) -> str:
        return json.dumps(value) if isinstance(value, (str, bool)) else show(value)

    pairs = [*spec.items(), *((key, _EXAMPLE_FIGURES[key]) for key in missing)]
    return "{ " + ", ".join(f"{key} = {toml(value)}" for key, value in pairs) + " }"


def _parse_device_spec(spec: Any, where: str) -> tuple[dict[str, Any], int]:
    """One entry of a node's ``devices``: returns (figures, count)."""
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping):
        raise ClusterError(f"{where}: a device is a type name or a table, got {show(spec)}")
    extra = set(spec) - _DEVICE_KEYS
    if extra:
        raise ClusterError(f"{where}: unknown device keys {sorted(extra)}; known: {sorted(_DEVICE_KEYS)}")
    if "type" not in spec:
        raise ClusterError(f"{where}: device table needs a 'type'")
    type_name = spec["type"]
    if not isinstance(type_name, str) or not type_name.strip():
        raise ClusterError(f"{where}: type must be a device type name, got {show(type_name)}")
    count = spec.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ClusterError(f"{where}: count must be a positive integer, got {show(count)}")
    if count > MAX_DEVICES:
        raise ClusterError(f"{where}: count {count} is more than the limit of {MAX_DEVICES} devices (MAX_DEVICES)")
    figures: dict[str, Any] = {"type_name": type_name}
    try:
        base = lookup_device_type(type_name)
        figures.update(
            type_name=base.name, peak_fp32_flops=base.peak_fp32_flops,
            peak_fp16_flops=base.peak_fp16_flops, memory_bytes=base.memory_bytes,
            memory_bandwidth_bytes_per_s=base.memory_bandwidth_bytes_per_s, peak_bf16_flops=base.peak_bf16_flops,
        )
    except KeyError as e:
        unknown_type_error = e.args[0]
        needed = ({"tflops", "peak_fp32_flops"}, {"memory", "memory_bytes"},
                  {"memory_bandwidth", "memory_bandwidth_bytes_per_s"})
        missing = [min(alternatives, key=len) for alternatives in needed if not spec.keys() & alternatives]
        if len(missing) == len(needed):  # no figures at all: most likely a misspelt catalog name
            raise ClusterError(
                f"{where}: {unknown_type_error} (a custom device needs tflops, memory and memory_bandwidth)"
            ) from None
        if missing:  # a custom device, short of some figures: name them, in the user's own table
            raise ClusterError(
                f"{where}: custom device type {type_name!r} (not in the catalog) is missing "
                f"{' and '.join(missing)}; for example {_custom_example(spec, missing)}"
            ) from None
    for human, si, scale in (("tflops", "peak_fp32_flops", 1e12), ("tflops_fp16", "peak_fp16_flops", 1e12),
                             ("tflops_bf16", "peak_bf16_flops", 1e12)):
        value = spec.get(si, spec.get(human))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            key = human if human in spec else si
            raise ClusterError(f"{where}: {key} must be a positive number, got {show(value)}")
        figures[si] = float(value) * (scale if si not in spec else 1.0)
    if "peak_fp16_flops" not in figures:
        figures["peak_fp16_flops"] = figures["peak_fp32_flops"]
    for human, si, parse in (("memory", "memory_bytes", parse_bytes),
                             ("memory_bandwidth", "memory_bandwidth_bytes_per_s", parse_bandwidth)):
        value = _quantity(spec, human, si, parse, where, required=False)
        if value is not None:
            figures[si] = value
    if "cpu_share" in spec:
        share = spec["cpu_share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 64:
            raise ClusterError(f"{where}: cpu_share must be a number in (0, 64], got {show(share)}")
        figures["cpu_share"] = float(share)
    return figures, count


def parse_device_type(text: str, where: str = "--device-spec") -> DeviceType:
    """A device type from the text of one cluster-file ``devices`` entry: a catalog name, or a TOML inline
    table with a custom type's figures (the catalog's for the fields it leaves out, if it is a catalog type).
    The result's ``source`` is ``where``.

    Raises:
        ClusterError: not TOML, or a field a cluster file would refuse (named, with ``where``).

    Example:
        >>> t = parse_device_type('{ type = "Foo", tflops = 12, memory = "24GB", memory_bandwidth = "346GB/s" }')
        >>> t.name, t.peak_fp32_flops / 1e12, t.peak_fp16_flops / 1e12, t.source
        ('Foo', 12.0, 12.0, '--device-spec')
    """
    bare = text.strip()
    if not bare.startswith(("{", '"', "'")):
        return parse_device_type(json.dumps(bare), where)
    try:
        spec: Any = tomllib.loads(f"spec = {bare}")["spec"]
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"{where} {text!r}: neither a type name in quotes nor a TOML inline table ({e}); for "
                           f"example {_custom_example({'type': 'P40'}, list(_EXAMPLE_FIGURES))}") from None
    figures, _ = _parse_device_spec(spec, f"{where} {text!r}")
    return DeviceType(figures["type_name"], figures["peak_fp32_flops"], figures["peak_fp16_flops"],
                      figures["memory_bytes"], figures["memory_bandwidth_bytes_per_s"], where,
                      figures.get("peak_bf16_flops"))


def parse_cluster(data: Mapping[str, Any], name: str = "cluster") -> Cluster:
    """Build a Cluster from the dict of a cluster file (human units or plain SI).

    Raises:
        ClusterError: with the node, field and value at fault.
    """
    if not isinstance(data, Mapping):
        raise ClusterError(f"a cluster is a table of [[node]] and [[link]], got {show(data)}")
    known_top = {"node", "link", "name", "emulation"}
    extra = set(data) - known_top
    if extra:
        raise ClusterError(f"unknown top-level keys {sorted(extra)}; a cluster file has [[node]] and [[link]]")
    if not isinstance(data.get("emulation", {}), Mapping):  # its fields: hetrain.emulate.settings
        raise ClusterError(f"[emulation] must be a table, got emulation = {show(data['emulation'])}")
    raw_nodes = data.get("node", [])
    if isinstance(raw_nodes, Mapping):
        raise ClusterError("'node' is a single table; write each node as [[node]] (an array of tables)")
    if not isinstance(raw_nodes, list):
        raise ClusterError(f"node must be [[node]] tables, got node = {show(raw_nodes)}")
    if not raw_nodes:
        raise ClusterError("the cluster is empty: add at least one [[node]] with devices")
    if len(raw_nodes) > MAX_NODES:
        raise ClusterError(f"{len(raw_nodes)} nodes is more than the limit of {MAX_NODES} (MAX_NODES)")
    cluster_name = data.get("name", name)
    if not isinstance(cluster_name, str) or not cluster_name.strip():
        raise ClusterError(f"name must be a non-empty string, got {show(cluster_name)}")
    nodes: list[Node] = []
    index = 0
    for k, raw in enumerate(raw_nodes):
        if not isinstance(raw, Mapping):
            raise ClusterError(f"node #{k}: expected a table, got {show(raw)}")
        node_name = raw.get("name", f"node{k}")
        if not isinstance(node_name, str) or not node_name.strip():
            raise ClusterError(f"node #{k}: name must be a non-empty string, got {show(node_name)}")
        where = f"node {node_name!r}"
        extra = set(raw) - {"name", "devices", "intra_link", "nic"}
        if extra:
            raise ClusterError(f"{where}: unknown keys {sorted(extra)}; a node has name, devices, intra_link, nic")
        raw_devices = raw.get("devices")
        if not isinstance(raw_devices, list) or not raw_devices:
            raise ClusterError(f"{where}: 'devices' must be a non-empty list, got {show(raw_devices)}")
        devices: list[Device] = []
        for spec in raw_devices:
            figures, count = _parse_device_spec(spec, f"{where} device #{len(devices)}")
            if index + count > MAX_DEVICES:
                raise ClusterError(f"{where} device #{len(devices)}: the cluster has more than the limit of "
                                   f"{MAX_DEVICES} devices (MAX_DEVICES)")
            for _ in range(count):
                devices.append(Device(name=f"{node_name}:{len(devices)}", node=node_name, index=index, **figures))
                index += 1
        intra = _parse_link(raw.get("intra_link", "pcie3"), f"{where}: intra_link", DEFAULT_INTRA_NODE_LATENCY_S)
        if "nic" not in raw and len(raw_nodes) > 1:
            raise ClusterError(f"{where}: missing 'nic' (for example nic = \"10Gbit/s\" or nic = \"ib-hdr\")")
        nic = _parse_link(raw.get("nic", "10gbe"), f"{where}: nic", DEFAULT_INTER_NODE_LATENCY_S)
        nodes.append(Node(node_name, tuple(devices), intra, nic))
    node_links: list[NodeLink] = []
    raw_links = data.get("link", [])
    if not isinstance(raw_links, list):
        raise ClusterError(f"[[link]] entries must be tables, got link = {show(raw_links)}")
    for k, raw in enumerate(raw_links):
        if not isinstance(raw, Mapping):
            raise ClusterError(f"link #{k}: expected a table")
        pair = raw.get("nodes")
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(n, str) for n in pair):
            raise ClusterError(f"link #{k}: 'nodes' must name exactly two nodes, got {show(pair)}")
        spec = {key: v for key, v in raw.items() if key != "nodes"}
        link = _parse_link(spec, f"link {pair}", DEFAULT_INTER_NODE_LATENCY_S)
        nl = NodeLink((str(pair[0]), str(pair[1])), link)
        for earlier in node_links:
            if set(earlier.nodes) == set(nl.nodes):
                raise ClusterError(f"link #{k}: nodes {pair} already have a [[link]]; give each pair one")
        node_links.append(nl)
    return Cluster(cluster_name, tuple(nodes), tuple(node_links))


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster TOML file.

    Raises:
        ClusterError: unreadable file, TOML syntax, or any invalid field (named).
    """
    p = Path(path)
    data = load_toml_object(p, ClusterError, "cluster file")
    try:
        return parse_cluster(data, name=p.stem)
    except ClusterError as e:
        raise ClusterError(f"{p}: {e}") from None


def tp_groups_of_node(node: Node, k: int) -> list[tuple[Device, ...]]:
    """The node's devices in TP groups of ``k``: consecutive devices of one type, k at a time (a type's last
    devices that do not fill a group are left out). ``k`` 1: each device alone.

    Consecutive devices share the fastest links of a node (an NVLink pair or quad of a board); cluster files
    list a node's devices in that order.
    """
    by_type: dict[str, list[Device]] = {}
    for d in node.devices:
        by_type.setdefault(d.type_name, []).append(d)
    out: list[tuple[Device, ...]] = []
    for devs in by_type.values():
        out.extend(tuple(devs[i:i + k]) for i in range(0, len(devs) - k + 1, k))
    return out


def tp_cluster(cluster: Cluster, k: int) -> Cluster:
    """The cluster as the planner sees it when every stage runs on a TP group of ``k`` devices: each group is one
    device, its first, carrying ``tp_group`` and ``tp_link`` (its node's intra-node link). Links between groups in
    a node are those between their first devices (rank j of one group reaches rank j of the other over its own
    pair); a node's NIC and explicit node links carry a k-th of their bandwidth (``share_link``). Nodes with no whole
    group are left out; ClusterError where none has one.

    Example:
        >>> c = tp_cluster(load_cluster("examples/clusters/a100-v100.toml"), 4)   # doctest: +SKIP
        >>> c.devices[0].tp_group                                                # doctest: +SKIP
        ('a0:0', 'a0:1', 'a0:2', 'a0:3')
    """
    if k == 1:
        return cluster
    nodes = []
    index = 0
    for n in cluster.nodes:
        leads = []
        for group in tp_groups_of_node(n, k):
            leads.append(replace(group[0], index=index, tp_group=tuple(d.name for d in group), tp_link=n.intra_link))
            index += 1
        if leads:
            nodes.append(replace(n, devices=tuple(leads), nic=share_link(n.nic, k)))
    if not nodes:
        raise ClusterError(f"no node of cluster {cluster.name!r} has {k} devices of one type for a TP group of {k}")
    kept = {n.name for n in nodes}
    links = tuple(replace(nl, link=share_link(nl.link, k)) for nl in cluster.node_links if set(nl.nodes) <= kept)
    return Cluster(cluster.name, tuple(nodes), links)


def share_link(link: Link, k: int) -> Link:
    """A node's network link as each of ``k`` TP ranks that use it at once sees it: a k-th of its bandwidth.

    Every rank of a TP group sends its k-th of a stage's output (``runtime.step.tp_transfer``: scatter / gather,
    ``ModelProfile.sent_bytes_per_sample``), and every rank reduces its own shard's gradients with the other VWs,
    so whatever one group device of ``tp_cluster`` moves across the network, its k ranks move at once over the
    node's one NIC."""
    return replace(link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s / k)
