"""torch's DTensor TP styles that ``runtime.tp``'s rules add to torch's own: imported only where a TP stage runs.

Apart from ``runtime.tp`` so that a rank without a TP stage never imports ``torch.distributed.tensor``: about a
second of CPU at every process's start (it brings sympy), in every rank of every job.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a fused projection of ``parts`` equal outputs (QKV: 3): each rank gets its columns of
    every part (a ``_StridedShard``, torch's placement for a shard of shards), so ``chunk(parts)`` of the local
    output gives its heads of q, k and v. torch's own ColwiseParallel would give rank 0 all of q and half of k."""

    def __init__(self, parts: int) -> None:
        super().__init__(output_layouts=_StridedShard(-1, split_factor=parts))
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in module.named_parameters():
            shard = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                      src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(shard, requires_grad=param.requires_grad))


__all__ = ["FusedColwiseParallel"]
