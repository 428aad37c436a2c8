"""Device choice at run time, so the same job runs on a GPU node and on a laptop unchanged."""

from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    """``cuda`` (the device SLURM/CUDA_VISIBLE_DEVICES exposes first) when available, else ``cpu``.

    ``GWENLAKE_DEVICE`` overrides the choice (e.g. ``cpu`` to keep a GPU node's job on the CPU).
    """
    forced = os.environ.get("GWENLAKE_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
