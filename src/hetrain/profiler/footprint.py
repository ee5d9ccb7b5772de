"""The runtime's memory footprint on a CUDA device: what a training process holds beyond its tensors.

Measured where the profiler runs (``hetrain profile --device cuda``), the figures of
``catalog.RuntimeFootprint``::

    fixed_bytes         device memory in use (the driver's count, ``torch.cuda.mem_get_info``)
                        less what PyTorch's allocator reserved, once CUDA is up and a one-rank
                        NCCL process group has run an all-reduce: the CUDA context, cuBLAS and
                        NCCL workspaces and buffers
    allocator_fraction  the caching allocator's reserve over the tensors' peak while the layers
                        were profiled: max_memory_reserved / max_memory_allocated - 1

A one-rank communicator holds fewer buffers than one with many peers (NCCL allocates per
peer and channel); a job's fixed footprint can be a few hundred MB larger.

The driver counts every process on the GPU: profile on a GPU nothing else uses.

Example:
    >>> fixed = measure_fixed_footprint(torch.device("cuda"))          # doctest: +SKIP
    >>> footprint = allocator_footprint(fixed, torch.device("cuda"))    # after profiling
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetrain.catalog import RuntimeFootprint


def measure_fixed_footprint(device: torch.device) -> float:
    """Bytes in use on ``device`` beyond the allocator's reserve, with a one-rank NCCL group up (CUDA only)."""
    with torch.cuda.device(device):
        torch.zeros(1, device=device)  # the context, and the allocator's first block
        started_group = False
        if not dist.is_initialized():
            store = dist.HashStore()  # type: ignore[attr-defined]  # public, not in torch's stubs
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
            started_group = True
        try:
            probe = torch.ones(1 << 20, device=device)
            if dist.get_backend() == "nccl":
                dist.all_reduce(probe)  # the communicator and its buffers exist from the first collective
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
            fixed = (total - free) - torch.cuda.memory_reserved(device)
            del probe
        finally:
            if started_group:
                dist.destroy_process_group()
    return float(max(fixed, 0))


def allocator_footprint(fixed_bytes: float, device: torch.device, type_name: str) -> RuntimeFootprint:
    """The footprint of ``device`` from its fixed bytes and the allocator's peaks so far (CUDA only)."""
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    fraction = max(reserved / allocated - 1.0, 0.0) if allocated > 0 else 0.0
    return RuntimeFootprint(fixed_bytes, fraction, f"measured on {type_name}")


__all__ = ["allocator_footprint", "measure_fixed_footprint"]
