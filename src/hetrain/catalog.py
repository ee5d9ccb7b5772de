"""Known device types and link presets, each figure with its source.

Rates are peak dense rates as vendors publish them; what a training step reaches
is a fraction of that (``ModelProfile.compute_efficiency``). ``peak_fp16_flops``
is the dense fp16/bf16 tensor-core rate with fp32 accumulation where the vendor
quotes both; for a device without fast half precision it equals the fp32 rate,
since frameworks then run half-precision matmuls no faster than fp32.
``peak_bf16_flops`` is set where bf16 runs slower than fp16: Volta (V100, TITAN V) and
Turing (T4, RTX 20xx, TITAN RTX) tensor cores take fp16 and not bf16 ([V100WP], [TU]:
bf16 tensor ops arrive with Ampere, [GA100WP]); there bf16 matmuls run on the CUDA cores,
so their bf16 rate is the fp32 rate. Elsewhere it is the fp16 rate (None).

Sources (vendor datasheets and whitepapers):
  [V100]   NVIDIA Tesla V100 datasheet (SXM2), 2018.
  [A100]   NVIDIA A100 Tensor Core GPU datasheet, 2021 (SXM).
  [H100]   NVIDIA H100 Tensor Core GPU datasheet, 2023 (SXM5, dense rates).
  [H200]   NVIDIA H200 Tensor Core GPU product brief, 2024 (SXM).
  [GH200]  NVIDIA GH200 Grace Hopper Superchip datasheet, 2023: the 96 GB HBM3 version, 4 TB/s;
           its Hopper GPU's rates are the H100 SXM's.
  [L4]     NVIDIA L4 datasheet, 2023 (dense = half the sparse figure).
  [T4]     NVIDIA T4 datasheet, 2019.
  [A10]    NVIDIA A10 datasheet, 2021 (dense).
  [TU]     NVIDIA Turing GPU architecture whitepaper, 2018, appendix A (RTX 2080, RTX 2080 Ti; GeForce
           Turing runs fp16 tensor ops with fp32 accumulate at half the fp16-accumulate
           rate) and the GeForce RTX 2060 specifications, 2019 (its tensor rate derived
           the same way: 240 tensor cores x 64 FMA x 2 FLOP x 1.68 GHz / 2).
  [TITANRTX] NVIDIA TITAN RTX product page, 2018: 130 tensor TFLOPS; unlike GeForce
           Turing, fp32 accumulate runs at the full rate.
  [GA102]  NVIDIA Ampere GA102 GPU architecture whitepaper, 2020 (RTX 3090).
  [AD102]  NVIDIA Ada GPU architecture whitepaper, 2022 (RTX 4090).
  [TITANV] NVIDIA TITAN V product page, 2017; Volta whitepaper.
  [V100WP] NVIDIA Tesla V100 GPU architecture whitepaper, 2017: Volta tensor cores take fp16 inputs only.
  [GA100WP] NVIDIA A100 Tensor Core GPU architecture whitepaper, 2020: "new BF16 ... Tensor Core
           operations" of the third-generation tensor core, which Volta and Turing lack.
  [P4000]  NVIDIA Quadro P4000 datasheet, 2017 (Pascal GP104: no tensor cores).
  [A10G]   NVIDIA A10G (GA102, AWS EC2 G5 instances): NVIDIA publishes no datasheet; the figures AWS and
           NVIDIA give for G5 (24 GB GDDR6, 600 GB/s, 35 TFLOPS fp32, 70 dense fp16/bf16 tensor TFLOPS),
           as compiled in "NVIDIA A10 vs A10G for ML model inference" (baseten.co, 2023).
  [L40S]   NVIDIA L40S datasheet, 2023 (dense = half the sparse figure: 362.05 of 733 TFLOPS).
  [A6000]  NVIDIA RTX A6000 datasheet, 2021: 38.7 TFLOPS fp32, 309.7 tensor TFLOPS with sparsity
           (dense: half); professional Ampere runs fp32 accumulate at the full rate.
  [H100PCIe] NVIDIA H100 Tensor Core GPU datasheet, 2023, H100 PCIe column (dense = half the sparse
           1,513 TFLOPS), 2.0 TB/s HBM2e.
  [H100NVL] NVIDIA H100 Tensor Core GPU datasheet, 2023, H100 NVL column, per GPU (dense = half the
           sparse 1,671 TFLOPS), 94 GB HBM3 at 3.9 TB/s.
  [P40]    NVIDIA Tesla P40 datasheet, 2016 (Pascal GP102: no tensor cores, fp16 at 1/64 rate: frameworks
           run half precision at the fp32 rate).
  [P100]   NVIDIA Tesla P100 PCIe datasheet, 2016: 9.3 TFLOPS fp32, 18.7 fp16 (packed half2, no tensor
           cores, no bf16), 16 GB HBM2 at 732 GB/s.
  [V100PCIe] NVIDIA Tesla V100 datasheet (PCIe column), 2018: 14 TFLOPS fp32, 112 tensor TFLOPS, 900 GB/s.
  [CPU]    nominal figures for one CPU process in emulation: about one AVX2 core
           (2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz ~ 96 GFLOP/s peak) and a
           share of DDR4 bandwidth. Emulated devices are re-scaled by measurement.
Runtime footprint (memory a training process holds on a device beyond its tensors):
  [CTX]    CUDA context and library workspaces: 781 MB held after CUDA starts in a PyTorch
           process before any tensor (pytorch/pytorch issue 34323); NCCL's buffers: 4 MiB
           (NCCL_BUFFSIZE) per channel, direction and peer, some tens of MB per communicator
           (NCCL environment-variable documentation). Together ~0.9 GB per CUDA device.
  [ALLOC]  PyTorch's caching allocator reserves more than its tensors need (``memory_reserved``
           over ``memory_allocated``; PyTorch "CUDA semantics: memory management"); 5% of the
           tensor peak assumed until ``hetrain profile`` measures it on the device.
Links:
  [PCIe]   PCI-SIG: 3.0 x16 ~15.75 GB/s, 4.0 x16 ~31.5 GB/s, 5.0 x16 ~63 GB/s per direction.
  [NVLink] NVIDIA: NVLink 2 (V100) 150 GB/s, NVLink 3 (A100) 300 GB/s,
           NVLink 4 (H100) 450 GB/s per direction per GPU.
  [IB]     InfiniBand Trade Association roadmap: EDR 100, HDR 200, NDR 400 Gbit/s per port.
  [Ethernet] IEEE 802.3 line rates: 10GBASE (802.3ae), 25GBASE (802.3by), 100GBASE (802.3ba).
  The ``loopback`` preset ([CPU]) is a nominal figure for processes on one host
  talking over TCP loopback in emulation.
  Latencies are typical one-way small-message figures reported by NCCL-tests and
  OSU micro-benchmarks: ~2-5 us on NVLink/PCIe, ~1-3 us on InfiniBand, ~10-50 us
  over TCP on Ethernet.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass

GB = 1e9
GiB = 2.0**30
TFLOPS = 1e12


@dataclass(frozen=True)
class DeviceType:
    """Published figures of one accelerator model.

    Attributes:
        name: catalog name, e.g. ``"A100-40GB"``.
        peak_fp32_flops: dense fp32 rate, FLOP/s.
        peak_fp16_flops: dense fp16 rate (tensor cores where present), FLOP/s; bf16's too unless
            ``peak_bf16_flops`` says otherwise.
        memory_bytes: device memory, bytes.
        memory_bandwidth_bytes_per_s: device memory bandwidth, bytes/s.
        source: the key of the source in this module's docstring.
        peak_bf16_flops: dense bf16 rate, FLOP/s, where it is not the fp16 rate (a device whose
            tensor cores take no bf16); None: the fp16 rate.
    """

    name: str
    peak_fp32_flops: float
    peak_fp16_flops: float
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    source: str
    peak_bf16_flops: float | None = None

    def peak_flops(self, precision: str) -> float:
        """The peak rate for ``precision`` (``"fp32"``, ``"fp16"`` or ``"bf16"``)."""
        return peak_flops_for(precision, self.peak_fp32_flops, self.peak_fp16_flops, self.peak_bf16_flops)


def peak_flops_for(precision: str, fp32_flops: float, fp16_flops: float, bf16_flops: float | None) -> float:
    """The rate of ``precision`` among a device's peak rates (FLOP/s); bf16 falls back to fp16's.

    Example:
        >>> peak_flops_for("bf16", 15.7e12, 125e12, 15.7e12) / 1e12
        15.7
    """
    if precision == "fp32":
        return fp32_flops
    if precision == "bf16" and bf16_flops is not None:
        return bf16_flops
    return fp16_flops


@dataclass(frozen=True)
class RuntimeFootprint:
    """Device memory a training process holds beyond its tensors (``cost.estimate_device_memory``).

    Attributes:
        fixed_bytes: held before the first tensor: the CUDA context, communication buffers,
            library workspaces.
        allocator_fraction: what the caching allocator reserves beyond the tensor peak, as a
            fraction of it (reserved over allocated, minus 1).
        source: where the figures come from (a catalog key, or ``measured on <device>``).
    """

    fixed_bytes: float
    allocator_fraction: float
    source: str

    def device_bytes(self, tensor_bytes: float) -> float:
        """Device memory in use when tensors take ``tensor_bytes`` at their peak."""
        return self.fixed_bytes + (1.0 + self.allocator_fraction) * tensor_bytes


#: no footprint: a CPU process (the host's memory is not what a plan is fitted to), or a device type
#: hetrain has no figures for
NO_FOOTPRINT = RuntimeFootprint(0.0, 0.0, "none")
#: a CUDA GPU running PyTorch with NCCL: sources [CTX] and [ALLOC]
CUDA_FOOTPRINT = RuntimeFootprint(0.9 * GB, 0.05, "CTX, ALLOC")


def default_footprint(type_name: str) -> RuntimeFootprint:
    """The catalog's footprint of a device type: CUDA_FOOTPRINT for the catalog's GPUs, none for
    ``cpu`` and for types the catalog does not know (custom types, emulated devices)."""
    key = DEVICE_ALIASES.get(type_name, type_name)
    if key == "cpu" or key not in DEVICE_TYPES:
        return NO_FOOTPRINT
    return CUDA_FOOTPRINT


@dataclass(frozen=True)
class LinkPreset:
    """Published figures of one interconnect: per-direction bandwidth and latency."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str


def _d(name: str, fp32_tflops: float, fp16_tflops: float, memory: float, bw_gb_s: float,
       source: str, bf16_tflops: float | None = None) -> DeviceType:
    return DeviceType(name, fp32_tflops * TFLOPS, fp16_tflops * TFLOPS, memory,
                      bw_gb_s * GB, source, None if bf16_tflops is None else bf16_tflops * TFLOPS)


DEVICE_TYPES: dict[str, DeviceType] = {
    d.name: d
    for d in [
        # Volta and Turing: no bf16 tensor cores, bf16 at the fp32 rate ([V100WP], [TU], [GA100WP])
        _d("V100-16GB", 15.7, 125.0, 16 * GiB, 900, "V100", bf16_tflops=15.7),
        _d("V100-32GB", 15.7, 125.0, 32 * GiB, 900, "V100", bf16_tflops=15.7),
        _d("A100-40GB", 19.5, 312.0, 40 * GiB, 1555, "A100"),
        _d("A100-80GB", 19.5, 312.0, 80 * GiB, 2039, "A100"),
        _d("H100", 67.0, 989.0, 80 * GiB, 3350, "H100"),
        _d("H200", 67.0, 989.0, 141 * GB, 4800, "H200"),
        _d("GH200", 67.0, 989.0, 96 * GB, 4000, "GH200"),
        _d("L4", 30.3, 121.0, 24 * GiB, 300, "L4"),
        _d("T4", 8.1, 65.0, 16 * GiB, 320, "T4", bf16_tflops=8.1),
        _d("A10", 31.2, 125.0, 24 * GiB, 600, "A10"),
        _d("RTX2060", 6.45, 25.8, 6 * GiB, 336, "TU", bf16_tflops=6.45),
        _d("RTX2080", 10.1, 40.3, 8 * GiB, 448, "TU", bf16_tflops=10.1),
        _d("RTX2080Ti", 13.4, 53.8, 11 * GiB, 616, "TU", bf16_tflops=13.4),
        _d("RTX3090", 35.6, 71.0, 24 * GiB, 936, "GA102"),
        _d("RTX4090", 82.6, 165.2, 24 * GiB, 1008, "AD102"),
        _d("TITAN-V", 14.9, 110.0, 12 * GiB, 653, "TITANV", bf16_tflops=14.9),
        _d("TITAN-RTX", 16.3, 130.0, 24 * GiB, 672, "TITANRTX", bf16_tflops=16.3),
        _d("P4000", 5.3, 5.3, 8 * GiB, 243, "P4000"),
        _d("A10G", 35.0, 70.0, 24 * GiB, 600, "A10G"),
        _d("L40S", 91.6, 362.05, 48 * GiB, 864, "L40S"),
        _d("RTX-A6000", 38.7, 154.85, 48 * GiB, 768, "A6000"),
        _d("H100-PCIe", 51.0, 756.5, 80 * GiB, 2000, "H100PCIe"),
        _d("H100-NVL", 60.0, 835.5, 94 * GiB, 3900, "H100NVL"),
        # Pascal and Volta PCIe: no bf16 tensor cores, bf16 at the fp32 rate ([V100WP], [GA100WP])
        _d("P40", 12.0, 12.0, 24 * GiB, 346, "P40", bf16_tflops=12.0),
        _d("P100", 9.3, 18.7, 16 * GiB, 732, "P100", bf16_tflops=9.3),
        _d("V100-PCIe-16GB", 14.0, 112.0, 16 * GiB, 900, "V100PCIe", bf16_tflops=14.0),
        _d("V100-PCIe-32GB", 14.0, 112.0, 32 * GiB, 900, "V100PCIe", bf16_tflops=14.0),
        _d("cpu", 0.096, 0.096, 16 * GiB, 20, "CPU"),
    ]
}

# Other spellings users write; each maps to a catalog name.
DEVICE_ALIASES: dict[str, str] = {
    "V100": "V100-16GB", "A100": "A100-40GB", "H100-80GB": "H100", "H100-SXM": "H100",
    "RTX-2060": "RTX2060", "RTX-2080": "RTX2080", "RTX-2080Ti": "RTX2080Ti", "RTX-3090": "RTX3090",
    "RTX-4090": "RTX4090", "TITANV": "TITAN-V", "TITAN V": "TITAN-V",
    "TITANRTX": "TITAN-RTX", "TITAN RTX": "TITAN-RTX", "Quadro-P4000": "P4000",
    "QuadroP4000": "P4000", "Quadro P4000": "P4000", "CPU": "cpu",
    "GH-96": "GH200", "GH200-96GB": "GH200", "A100-40": "A100-40GB", "A100-80": "A100-80GB", "V100-16": "V100-16GB",
    "RTX A6000": "RTX-A6000", "RTXA6000": "RTX-A6000", "A6000": "RTX-A6000", "L40S-48GB": "L40S",
    "H100 PCIe": "H100-PCIe", "H100PCIe": "H100-PCIe", "H100 NVL": "H100-NVL", "H100NVL": "H100-NVL",
    "Tesla P40": "P40", "Tesla P100": "P100", "P100-16GB": "P100", "P100-PCIe": "P100",
    # the names ``hetrain profile`` gave these cards before the catalog knew them (the driver's, dashed)
    "Tesla-P40": "P40", "Tesla-P100-PCIE-16GB": "P100",
    "V100-PCIe": "V100-PCIe-16GB", "V100 PCIe": "V100-PCIe-16GB",
}

LINK_PRESETS: dict[str, LinkPreset] = {
    p.name: p
    for p in [
        LinkPreset("pcie3", 15.75 * GB, 5e-6, "PCIe"),
        LinkPreset("pcie4", 31.5 * GB, 5e-6, "PCIe"),
        LinkPreset("pcie5", 63.0 * GB, 5e-6, "PCIe"),
        LinkPreset("nvlink2", 150 * GB, 2e-6, "NVLink"),
        LinkPreset("nvlink3", 300 * GB, 2e-6, "NVLink"),
        LinkPreset("nvlink4", 450 * GB, 2e-6, "NVLink"),
        LinkPreset("10gbe", 10e9 / 8, 30e-6, "Ethernet"),
        LinkPreset("25gbe", 25e9 / 8, 20e-6, "Ethernet"),
        LinkPreset("100gbe", 100e9 / 8, 10e-6, "Ethernet"),
        LinkPreset("ib-edr", 100e9 / 8, 2e-6, "IB"),
        LinkPreset("ib-hdr", 200e9 / 8, 2e-6, "IB"),
        LinkPreset("ib-ndr", 400e9 / 8, 2e-6, "IB"),
        LinkPreset("loopback", 5 * GB, 20e-6, "CPU"),
    ]
}

# Latency assumed for a link given by bandwidth alone.
DEFAULT_INTRA_NODE_LATENCY_S = 5e-6
DEFAULT_INTER_NODE_LATENCY_S = 20e-6


def _suggest(name: str, known: list[str]) -> str:
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    if not near:
        near = [k for k in known if name.lower()[:3] in k.lower()][:3]
    return f"; did you mean {', '.join(repr(n) for n in near)}?" if near else "."


def lookup_device_type(name: str) -> DeviceType:
    """The catalog entry for ``name`` (exact, alias, or case-insensitive).

    Raises:
        KeyError: unknown name; the message suggests near names and lists the catalog.

    Example:
        >>> lookup_device_type("a100-40gb").memory_bytes / 2**30
        40.0
    """
    if name in DEVICE_TYPES:
        return DEVICE_TYPES[name]
    if name in DEVICE_ALIASES:
        return DEVICE_TYPES[DEVICE_ALIASES[name]]
    folded = {k.lower(): k for k in [*DEVICE_TYPES, *DEVICE_ALIASES]}
    if name.lower() in folded:
        return lookup_device_type(folded[name.lower()])
    known = list(DEVICE_TYPES)
    raise KeyError(
        f"unknown device type {name!r}{_suggest(name, known + list(DEVICE_ALIASES))} "
        f"Known types: {', '.join(known)}. Or describe it inline: "
        f"{{ type = {json.dumps(name)}, tflops = 10.0, memory = \"16GB\", memory_bandwidth = \"500GB/s\" }}"
    )


def lookup_link_preset(name: str) -> LinkPreset:
    """The link preset ``name`` (case-insensitive); KeyError naming near presets."""
    key = name.lower().replace(" ", "").replace("_", "-")
    if key in LINK_PRESETS:
        return LINK_PRESETS[key]
    known = list(LINK_PRESETS)
    raise KeyError(f"unknown link preset {name!r}{_suggest(key, known)} Known presets: {', '.join(known)}")
