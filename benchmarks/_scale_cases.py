"""The clusters and models of the scale benchmarks (issue 21): planner_scale.py and simulator_scale.py.

Large clusters: nodes of 8 GPUs of four generations in turn, each with its own NVLink or PCIe
inside and its own NIC, from 200 down to 10 Gbit/s (between two nodes the slower NIC applies)::

    node k % 4 == 0   8 x H100        NVLink 4   InfiniBand HDR  200 Gbit/s
    node k % 4 == 1   8 x A100-80GB   NVLink 3   InfiniBand EDR  100 Gbit/s
    node k % 4 == 2   8 x V100-32GB   NVLink 2   25 GbE
    node k % 4 == 3   8 x T4          PCIe 3     10 GbE

Models: gpt2-medium (26 layers), gpt2-xl (50), and a GPT of 200 layers (198 blocks of
gpt2-medium's width). Small random instances (at most 64 devices) for the planner's
choice against the simulated best of its top 50.
"""

from __future__ import annotations

import random

from hetrain.cluster import Cluster, parse_cluster
from hetrain.models.analytic import build_gpt_profile, build_profile
from hetrain.profile import ModelProfile

GPUS_PER_NODE = 8
NODE_KINDS = [("H100", "nvlink4", "ib-hdr"), ("A100-80GB", "nvlink3", "ib-edr"),
              ("V100-32GB", "nvlink2", "25gbe"), ("T4", "pcie3", "10gbe")]
SIZES = (64, 256, 1024, 4096)
MODELS = ("gpt2-medium", "gpt-200")
SMALL_TYPES = [("H100", "nvlink4"), ("A100-80GB", "nvlink3"), ("A100-40GB", "nvlink3"), ("V100-32GB", "nvlink2"),
               ("T4", "pcie3"), ("RTX3090", "pcie4")]
SMALL_NICS = ("10gbe", "25gbe", "100gbe", "ib-hdr")


def build_cluster(num_devices: int) -> Cluster:
    """``num_devices / 8`` nodes of the four kinds in turn (module docstring)."""
    nodes = [{"name": f"n{k:03d}", "devices": [{"type": kind, "count": GPUS_PER_NODE}], "intra_link": intra,
              "nic": nic}
             for k in range(num_devices // GPUS_PER_NODE) for kind, intra, nic in [NODE_KINDS[k % len(NODE_KINDS)]]]
    return parse_cluster({"name": f"hetero-{num_devices}", "node": nodes})


def build_model(name: str) -> ModelProfile:
    """``gpt-200``: 198 blocks of width 1024 (16 heads, 1024 tokens) between the embedding and the head;
    any other name: the reference model."""
    if name == "gpt-200":
        return build_gpt_profile(198, 1024, 16, 1024, 50257, name="gpt-200")
    return build_profile(name)


def random_instance(seed: int) -> tuple[Cluster, ModelProfile, int]:
    """A random small instance: 2 to 8 nodes of 1 to 8 devices of one type each (at most 64 devices, at least
    2 types), NICs of 10 to 200 Gbit/s, a GPT of 6 to 48 blocks, a global batch of 16 to 512."""
    rng = random.Random(seed)
    num_nodes = rng.randint(2, 8)
    per_node = [rng.choice((1, 2, 4, 8)) for _ in range(num_nodes)]
    kinds = [rng.choice(SMALL_TYPES) for _ in range(num_nodes)]
    if len({k for k, _ in kinds}) < 2:
        kinds[-1] = next(k for k in SMALL_TYPES if k[0] != kinds[0][0])
    nodes = [{"name": f"n{k}", "devices": [{"type": kind, "count": count}], "intra_link": intra,
              "nic": rng.choice(SMALL_NICS)}
             for k, ((kind, intra), count) in enumerate(zip(kinds, per_node, strict=True))]
    cluster = parse_cluster({"name": f"random-{seed}", "node": nodes})
    hidden, heads = rng.choice(((512, 8), (768, 12), (1024, 16)))
    blocks = rng.randint(6, 48)
    profile = build_gpt_profile(blocks, hidden, heads, rng.choice((256, 512, 1024)), 50257,
                                name=f"gpt-{blocks}x{hidden}")
    return cluster, profile, rng.choice((16, 32, 64, 128, 256, 512))
