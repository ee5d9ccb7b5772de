"""The cluster the planner sees after discovery: the file's devices, the discovered links.

A cluster file gives devices and nominal links; link discovery (``hetrain.profiler.network``)
writes a cluster TOML whose links are measured. The planner wants both::

    nominal  (cluster file)     devices, types, shares, [emulation]   ─┐
                                                                       ├─► with_discovered_links
    discovered (discover -o)    intra_link, nic per node; [[link]]s   ─┘     (+ latency per node end)

``with_discovered_links`` is the merge, with an extra latency per node added to every link at
each of its ends. ``with_measured_links`` is the merge for an emulated cluster: the extra latency
is the quota stall that discovery could not have met (``quota_stall_by_node``).

Both work on the cluster's TOML tables (dicts), before ``cluster.parse_cluster``; pure Python,
no torch.

Example:
    >>> nominal = {"node": [{"name": "a", "devices": ["cpu"], "nic": "1Gbit/s"}]}
    >>> found = {"node": [{"name": "a", "nic": {"bandwidth_bytes_per_s": 1.2e8, "latency_s": 0.001}}]}
    >>> with_discovered_links(nominal, found, {"a": 0.002})["node"][0]["nic"]["latency_s"]
    0.003
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def with_discovered_links(nominal: Mapping[str, Any], discovered: Mapping[str, Any],
                          extra_latency_s: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The nominal cluster (device types, shares) with the discovered intra links, NICs and [[link]]s.

    Each discovered link's latency is raised by ``extra_latency_s[node]`` at each end on that node:
    twice for a node's intra link, once for its NIC, once per node for a [[link]]. A node that
    discovery did not report keeps its nominal links; a discovered [[link]] list replaces the
    nominal one. The ``[emulation]`` table is dropped (the planner has no use for it).

    Args:
        nominal: the cluster file's tables (``tomllib.loads``); not modified.
        discovered: the discovered cluster's tables; links as ``{"bandwidth_bytes_per_s", "latency_s"}``.
        extra_latency_s: seconds to add per node end; a node not named adds 0.
    """
    extra = extra_latency_s or {}
    out: dict[str, Any] = json.loads(json.dumps(nominal))
    found = {n["name"]: n for n in discovered.get("node", [])}
    for node in out["node"]:
        d = found.get(node["name"])
        if d is None:
            continue
        stall_s = extra.get(node["name"], 0.0)
        for key, ends in (("intra_link", 2), ("nic", 1)):
            if isinstance(d.get(key), dict):
                node[key] = {**d[key], "latency_s": float(d[key].get("latency_s", 0.0)) + ends * stall_s}
    if discovered.get("link"):
        out["link"] = [{**link, "latency_s": float(link.get("latency_s", 0.0))
                        + sum(extra.get(n, 0.0) for n in link["nodes"])} for link in discovered["link"]]
    out.pop("emulation", None)
    return out


def quota_stall_by_node(nominal: Mapping[str, Any]) -> dict[str, float]:
    """Per node of an emulated cluster, the quota stall (s) a message meets at one of its ends in
    training that link discovery did not meet: that of the node's most throttled device.

    A throttled device that has used its CPU quota stalls until its next period before it
    handles a message. With ``fill_idle`` (the default) every throttled device uses up its quota
    in every period, busy or idle, so the discovery's ping-pong meets the stall as training does
    (a message arriving at a random moment waits (1 - share)^2 x period / 2 on average), and it
    is in the measured latency: every node gets 0. Without ``fill_idle``, an idle device banks
    quota and answers a ping at once, while a training device runs out of quota at every stretch
    of compute, so each message it sends or receives after one meets (1 - share) x period / 2
    on average (``emulate.cgroups.quota_stall``), share = ``cpu_share`` x ``cpu_scale``.
    """
    from hetrain.emulate import parse_emulation_settings
    from hetrain.emulate.cgroups import quota_stall

    settings = parse_emulation_settings(nominal.get("emulation"))
    unseen = not settings.fill_idle  # with the filler, discovery met the stall: it is in the measured latency
    stall: dict[str, float] = {}
    for node in nominal["node"]:
        shares = [float(d["cpu_share"]) * settings.cpu_scale for d in node.get("devices", [])
                  if isinstance(d, dict) and d.get("cpu_share") is not None]
        stall[node["name"]] = max((quota_stall(s, settings.cpu_period_s) for s in shares if unseen), default=0.0)
    return stall


def with_measured_links(nominal: Mapping[str, Any], discovered: Mapping[str, Any]) -> dict[str, Any]:
    """The nominal emulated cluster with the discovered links, each link's latency raised by the quota
    stall of the emulated devices at its ends where the discovery could not have met it
    (``quota_stall_by_node``)."""
    return with_discovered_links(nominal, discovered, quota_stall_by_node(nominal))
