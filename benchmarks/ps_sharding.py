"""Do WSP and hybrid-ps keep up with BSP once their parameter servers are sharded? (predicted)

Four nodes on 10 GbE, two of two RTX 3090s and two of two RTX 2080s; gpt2-small at global
batch 256, pure data parallelism (8 VWs, `hetrain plan --strategy dp`). On the same VWs, for
bsp, wsp and hybrid-ps (D = 1, hybrid-ps aggregating 4 iterations, the defaults), each
parameter-server placement: `local` (the whole segment's server on one device, what plans of
format 4 did) and `sharded` (one shard per node, sized by NIC bandwidth, the default since
format 5). Reported: the closed form's and the simulator's samples/s and each against BSP's.
A parameter server is sharded over the servers in Li et al. (OSDI 2014); HetPipe (Park et al.,
ATC 2020) runs several. Staleness is meant to hide the exchange, not to add to it.

    python benchmarks/ps_sharding.py [--no-write]
"""

from __future__ import annotations

import argparse

from _results import write_section
from hetrain.cluster import parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.planner import plan
from hetrain.planner.sync import repredict_sync
from hetrain.simulator import simulate
from hetrain.sync_layout import SyncOptions

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]

#: the example cluster: every NIC 10 GbE, PCIe 3 inside a node
CLUSTER_TOML = """
name = "four-10gbe"
[[node]]
name = "n0"
devices = [{ type = "RTX3090", count = 2 }]
intra_link = "pcie3"
nic = "10gbe"
[[node]]
name = "n1"
devices = [{ type = "RTX3090", count = 2 }]
intra_link = "pcie3"
nic = "10gbe"
[[node]]
name = "n2"
devices = [{ type = "RTX2080", count = 2 }]
intra_link = "pcie3"
nic = "10gbe"
[[node]]
name = "n3"
devices = [{ type = "RTX2080", count = 2 }]
intra_link = "pcie3"
nic = "10gbe"
"""
MODEL, GLOBAL_BATCH = "gpt2-small", 256
CASES = [("bsp", "local"), ("wsp", "local"), ("wsp", "sharded"), ("hybrid-ps", "local"), ("hybrid-ps", "sharded")]


def measure() -> list[tuple[str, str, float, float]]:
    """(mode, placement, closed-form samples/s, simulated samples/s) of each case, on the DP plan's VWs."""
    cluster = parse_cluster(tomllib.loads(CLUSTER_TOML))
    profile = build_profile(MODEL, precision="fp16")  # `hetrain plan` plans the reference GPT-2 in fp16 on GPUs
    base = plan(cluster, profile, GLOBAL_BATCH, strategy="dp", sync="bsp", simulate_top_k=0)
    out = []
    for mode, placement in CASES:
        p = repredict_sync(base, mode, SyncOptions(placement=placement))
        out.append((mode, placement if mode != "bsp" else "-", p.prediction.samples_per_s,
                    GLOBAL_BATCH / simulate(p, iterations=12).iteration_s))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = measure()
    closed_bsp, sim_bsp = rows[0][2], rows[0][3]
    lines = ["| sync | server placement | closed form samples/s | vs BSP | simulated samples/s | vs BSP |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for mode, placement, closed, simulated in rows:
        lines.append(f"| {mode} | {placement} | {closed:.1f} | {closed / closed_bsp:.2f}x | {simulated:.1f} | "
                     f"{simulated / sim_bsp:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_section(
            "Sharded parameter servers", "python benchmarks/ps_sharding.py", table,
            f"{MODEL}, global batch {GLOBAL_BATCH}, `--strategy dp` (8 VWs) on four 10 GbE nodes (2x RTX 3090, "
            "2x RTX 3090, 2x RTX 2080, 2x RTX 2080), sync options at their defaults (D = 1, hybrid-ps aggregate 4). "
            "`local`: each segment's whole server on one device (plans of format 4); `sharded`: one shard per "
            "node, sized by NIC bandwidth (format 5's default). Predicted, not measured. Before format 5 the "
            "closed form charged a wave its whole round trip less D iterations of compute and put WSP on one host "
            "at 40.6 samples/s here; the replay shows D + 1 waves sharing one round trip (docs/sync.md, Timing).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
