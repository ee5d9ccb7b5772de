"""Your own model and data, for hetrain: a small MLP classifier and a synthetic data set it can learn.

    hetrain profile --model examples/own_model/model.py:build --data examples/own_model/model.py:dataset \
        -o profile.json
    hetrain plan --cluster CLUSTER.toml --profile profile.json --global-batch 32 -o plan.json
    torchrun --nproc-per-node 2 -m hetrain train --plan plan.json --model examples/own_model/model.py:build \
        --data examples/own_model/model.py:dataset --steps 100

hetrain calls ``build()`` with torch's generator seeded (``--seed``), and cuts the
``nn.Sequential`` it returns into its children: layer 0 is the first Linear, layer 1 its
ReLU, and so on; a plan places a contiguous range of them on each device. ``dataset()``
returns ``(train, validation)``; both must be the same on every rank, so they are made from
a fixed seed. Without a ``loss_fn`` here hetrain would use cross-entropy, which is what this
model needs too; it is written out to show the hook. See docs/own-model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, CLASSES, HIDDEN = 16, 4, 64


def build() -> nn.Sequential:
    """The model: 16 features -> 64 -> 64 -> 4 class scores, cut into 5 layers."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def _blobs(n: int, seed: int) -> TensorDataset:
    """``n`` points around one of ``CLASSES`` fixed centres each, labelled with their centre."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 2  # (C, F)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)  # (n,)
    points = centres[labels] + torch.randn(n, FEATURES, generator=g)  # (n, F)
    return TensorDataset(points, labels)


def dataset() -> tuple[TensorDataset, TensorDataset]:
    """``(train, validation)``: 2,048 and 256 labelled points, the same on every call."""
    return _blobs(2048, seed=1), _blobs(256, seed=2)


def loss_fn(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean loss of a micro-batch: (B, CLASSES) scores and (B,) labels."""
    return F.cross_entropy(scores, labels)
