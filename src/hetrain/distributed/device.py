"""Which device and process-group backend a rank uses.

A rank trains on ``cuda:LOCAL_RANK`` with NCCL where CUDA is available, else on
the CPU with Gloo. ``HETRAIN_DEVICE=cpu`` forces the CPU and Gloo on a machine
with GPUs (to debug, or to run the CPU test suite there); ``HETRAIN_DEVICE=cuda``
refuses to start without CUDA instead of falling back to the CPU.

A node with fewer GPUs than processes is refused by name before NCCL is touched:
NCCL cannot put two ranks on one GPU, and CUDA's own error ("invalid device
ordinal") does not say which setting is wrong.
"""

from __future__ import annotations

import os

import torch

from hetrain.errors import RunError

DEVICE_VARIABLE = "HETRAIN_DEVICE"
CHOICES = ("auto", "cpu", "cuda")


class DeviceError(RunError):
    """The rank cannot have the device its launch asks for (named, with the counts)."""


def choose_device(local_rank: int) -> tuple[str, torch.device]:
    """The backend (``"nccl"`` or ``"gloo"``) and device for the rank with this ``LOCAL_RANK``.

    Raises:
        DeviceError: ``HETRAIN_DEVICE`` is not one of ``auto``, ``cpu``, ``cuda``;
            ``cuda`` asked for without CUDA; or more processes on this node
            than it has GPUs.
    """
    choice = os.environ.get(DEVICE_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise DeviceError(f"{DEVICE_VARIABLE}={os.environ[DEVICE_VARIABLE]!r}: expected one of {', '.join(CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return "gloo", torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{DEVICE_VARIABLE}=cuda, but CUDA is not available to this process "
                          "(a CPU build of torch, no driver, or CUDA_VISIBLE_DEVICES empty)")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"LOCAL_RANK {local_rank}, but this node has {count} CUDA device(s): a rank needs a GPU of its own "
            f"under NCCL. Start at most {count} process(es) on this node (torchrun --nproc-per-node {count}), "
            f"or set {DEVICE_VARIABLE}=cpu to run every rank on the CPU with Gloo.")
    torch.cuda.set_device(local_rank)
    return "nccl", torch.device("cuda", local_rank)
