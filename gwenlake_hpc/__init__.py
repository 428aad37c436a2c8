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
    "train": ".api", "Input": ".api", "Output": ".api", "Model": ".api", "TrainFunction": ".api",
    "default_device": ".device",
    "CheckpointError": ".errors", "ConfigError": ".errors", "DataError": ".errors", "GwenlakeError": ".errors",
    "LoadedModel": ".registry", "load_model": ".registry", "save_model": ".registry",
    "Run": ".run", "ShieldedWorkerInit": ".rng", "log_metrics": ".current", "current_run": ".current",
    "checkpoint": ".current", "last_checkpoint_path": ".current", "log_rollout": ".current",
    "load_state": ".checkpoints.state", "save_state": ".checkpoints.state",
    "log_custom_metric": ".tracking.custom_metrics",
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
