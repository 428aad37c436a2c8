"""The process's random state and its DataLoader worker processes, as the Run saves and restores them.

:func:`rng_state` / :func:`set_rng_state` (Python, numpy, torch CPU and CUDA, JSON-able, in each checkpoint),
:func:`seed_everything`, and :class:`ShieldedWorkerInit` (DataLoader workers that ignore SLURM's stop signals).
"""

from __future__ import annotations

import base64
import importlib.abc
import logging
import random
import sys
import threading
from typing import Any, Mapping

import numpy as np

# torch is imported where a state is read or set, not here: a short fit that never uses torch does not pay its
# import (about 2 s of CPU), and seed_everything seeds torch when it is imported (see _SeedTorchOnImport).

log = logging.getLogger("gwenlake_hpc.run")


# --- RNG state ------------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Python, numpy (global), torch CPU and (if initialised) CUDA RNG states, as JSON-able values."""
    import torch

    py = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import torch

    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss_np = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss_np))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy()) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("checkpoint has CUDA RNG states for %d devices, this node has %d: not restored",
                        len(cuda), torch.cuda.device_count())


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's global and torch's (all devices) RNGs.

    torch is seeded now when it is imported already, else right after its import, whenever that happens in
    this process: nothing can draw from its RNG before, so the state is the same either way.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "manual_seed"):
        _SeedTorchOnImport.pending = None
        torch.manual_seed(seed)
    else:
        _SeedTorchOnImport.defer(seed)


class _SeedTorchOnImport(importlib.abc.MetaPathFinder):
    """A finder that only wraps torch's loader, so that ``torch.manual_seed(pending)`` runs once its import
    completes (Python has no post-import hook); it removes itself then."""

    pending: int | None = None
    _lock = threading.Lock()
    _installed: "_SeedTorchOnImport | None" = None

    @classmethod
    def defer(cls, seed: int) -> None:
        with cls._lock:
            cls.pending = seed  # a later call replaces the seed
            if cls._installed is None:
                cls._installed = cls()
                sys.meta_path.insert(0, cls._installed)

    @classmethod
    def _uninstall(cls) -> None:
        with cls._lock:
            if cls._installed is not None:
                if cls._installed in sys.meta_path:
                    sys.meta_path.remove(cls._installed)
                cls._installed = None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        self._uninstall()
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _SeedingLoader(spec.loader)
        return spec


class _SeedingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        seed, _SeedTorchOnImport.pending = _SeedTorchOnImport.pending, None
        if seed is not None:
            module.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package...: torch's own loader
        return getattr(self._inner, name)


# --- worker processes ---------------------------------------------------------------------------------------

class ShieldedWorkerInit:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore the stop signals, then calls the user's.

    SLURM signals every process of the job step (preemption, scancel, the time-limit warning), and PyTorch's
    workers install a handler that dies on SIGTERM: the main process would then fail with "DataLoader worker
    killed" in the middle of a step instead of checkpointing at its end. Workers ignore the signals; the main
    process decides, and its exit ends them (PyTorch's shutdown, or its watchdog when the parent is gone).
    Picklable, so it works with the ``spawn`` start method too.
    """

    def __init__(self, inner: Any = None):
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        import signal

        from .signals import STOP_SIGNALS

        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def shield_workers(batches: Any) -> None:
    """Give a ``torch.utils.data.DataLoader`` with worker processes a :class:`ShieldedWorkerInit` (once)."""
    if "torch.utils.data" not in sys.modules:  # then ``batches`` is no DataLoader: torch stays unimported
        return
    from torch.utils.data import DataLoader

    if isinstance(batches, DataLoader) and batches.num_workers > 0 \
            and not isinstance(batches.worker_init_fn, ShieldedWorkerInit):
        batches.worker_init_fn = ShieldedWorkerInit(batches.worker_init_fn)
