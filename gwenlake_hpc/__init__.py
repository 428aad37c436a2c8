"""gwenlake_hpc: long ML trainings on SLURM clusters that survive preemption, time limits and lost nodes.

Write one ordinary training function, decorate it with :func:`train`, and run it with
``python -m gwenlake_hpc +job=NAME`` or ``gwenlake-train``.

The names below are imported on first use (PEP 562), so that a process that needs one module (the tracking
delivery process, a command) does not pay for torch and git.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "train": ".decorator", "Input": ".decorator", "Output": ".decorator", "Model": ".decorator",
    "TrainFunction": ".decorator",
    "default_device": ".runtime.device",
    "CheckpointError": ".base.errors", "ConfigError": ".base.errors", "DataError": ".base.errors",
    "GwenlakeError": ".base.errors",
    "LoadedModel": ".stores.registry", "load_model": ".stores.registry", "save_model": ".stores.registry",
    "Run": ".runtime.run", "ShieldedWorkerInit": ".runtime.rng", "log_metrics": ".runtime.current",
    "current_run": ".runtime.current", "checkpoint": ".runtime.current",
    "last_checkpoint_path": ".runtime.current", "log_rollout": ".runtime.current",
    "load_state": ".stores.checkpoints.state", "save_state": ".stores.checkpoints.state",
    "wait_for_staging": ".stores.checkpoints.buffers",
    "log_custom_metric": ".stores.tracking.custom_metrics",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gwenlake_hpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
