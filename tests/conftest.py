"""Shared test set-up: seeded randomness, and one torch thread per process.

On a 2-core machine torch's default thread pool makes small CPU kernels 15-90x
slower when other processes run, so tests use one thread (torchrun does the same).
Ranks run on the CPU (``HETRAIN_DEVICE=cpu``) unless a test asks for CUDA.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite runs every rank on the CPU with Gloo, also on a machine with GPUs (where
# NCCL would need a GPU per rank); tests/gpu/ asks for CUDA where it checks the GPU path.
os.environ.setdefault("HETRAIN_DEVICE", "cpu")
# Traced cuts (hetrain.models.trace.save_cut) are kept for the session in a folder of its own, not in the
# user's cache; processes the tests start find them there too.
if "HETRAIN_CACHE_DIR" not in os.environ:
    os.environ["HETRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hetrain-cuts-")
    atexit.register(shutil.rmtree, os.environ["HETRAIN_CACHE_DIR"], True)  # removed with the session


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    try:
        import torch
    except ImportError:  # the planning-side tests need no torch
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
