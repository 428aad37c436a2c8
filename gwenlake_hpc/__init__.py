"""gwenlake_hpc: long ML trainings on SLURM clusters that survive preemption, time limits and lost nodes.

Write one ordinary training function, decorate it with :func:`train`, and run it with
``python -m gwenlake_hpc +job=NAME`` or ``gwenlake-train``.
"""

__version__ = "0.1.0"

from .api import Input, Model, Output, TrainFunction, train  # noqa: E402
from .device import default_device  # noqa: E402
from .errors import CheckpointError, ConfigError, DataError, GwenlakeError  # noqa: E402
from .registry import LoadedModel, load_model  # noqa: E402
from .run import Run, ShieldedWorkerInit  # noqa: E402
from .checkpoint.state import load_state, save_state  # noqa: E402

__all__ = ["train", "Input", "Output", "Model", "Run", "TrainFunction", "save_state", "load_state",
           "default_device", "load_model", "LoadedModel", "ShieldedWorkerInit", "ConfigError", "DataError",
           "CheckpointError", "GwenlakeError", "__version__"]
