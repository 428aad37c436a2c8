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

def rng_state(torch_if_imported: bool = False) -> dict[str, Any]:
    """Python, numpy (global), torch CPU and (if initialised) CUDA RNG states, as JSON-able values.

    With ``torch_if_imported`` a process that has not imported torch gets no ``torch`` entry (nothing there
    can have drawn from it) instead of paying its import.
    """
    py = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    if torch_if_imported and "torch" not in sys.modules:
        return state
    import torch

    _settle_torch_seed()
    state["torch"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (torch's only if the state has a ``torch`` entry)."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss_np = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss_np))
    if "torch" not in state:
        return
    import torch

    _settle_torch_seed(restoring=True)  # else the next rng_state() would seed over the restored state
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
    this process: nothing can draw from its RNG before, so the state is the same either way. A torch imported
    by another import hook ahead of gwenlake's (which then never sees it) is seeded at the next
    :func:`rng_state` or :func:`set_rng_state`, or by the next call of this function.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "manual_seed"):
        _SeedTorchOnImport.pending = None
        _SeedTorchOnImport.uninstall()
        torch.manual_seed(seed)
    else:
        _SeedTorchOnImport.defer(seed)


def _settle_torch_seed(restoring: bool = False) -> None:
    """Give an imported torch the seed still pending (its import went past :class:`_SeedTorchOnImport`), or
    drop that seed when a state is about to be restored over it."""
    torch = sys.modules.get("torch")
    if _SeedTorchOnImport.pending is None or torch is None or not hasattr(torch, "manual_seed"):
        return
    with _SeedTorchOnImport._lock:
        seed, _SeedTorchOnImport.pending = _SeedTorchOnImport.pending, None
    _SeedTorchOnImport.uninstall()
    if seed is not None and not restoring:
        log.warning("torch was imported past gwenlake's import hook (another hook ahead of it in sys.meta_path): "
                    "it is seeded now, draws made from it before are not reproducible")
        torch.manual_seed(seed)


class _SeedTorchOnImport(importlib.abc.MetaPathFinder):
    """A finder that only wraps torch's loader, so that ``torch.manual_seed(pending)`` runs once its import
    completes (Python has no post-import hook); it removes itself then.

    It stays in ``sys.meta_path`` until torch's module has run: a mere ``importlib.util.find_spec("torch")``
    (transformers, accelerate and lightning probe so) is answered with the wrapped loader and changes nothing.
    """

    pending: int | None = None
    _lock = threading.Lock()
    _installed: "_SeedTorchOnImport | None" = None
    _searching = threading.local()  # set while this thread asks the other finders (find_spec re-enters us)

    @classmethod
    def defer(cls, seed: int) -> None:
        with cls._lock:
            cls.pending = seed  # a later call replaces the seed
            if cls._installed is None:
                cls._installed = cls()
                sys.meta_path.insert(0, cls._installed)

    @classmethod
    def uninstall(cls) -> None:
        with cls._lock:
            if cls._installed is not None:
                if cls._installed in sys.meta_path:
                    sys.meta_path.remove(cls._installed)
                cls._installed = None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch" or getattr(self._searching, "active", False):
            return None
        import importlib.util

        self._searching.active = True
        try:
            spec = importlib.util.find_spec("torch")  # the finders after this one (it answers None meanwhile)
        finally:
            self._searching.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if not isinstance(spec.loader, _SeedingLoader):
            spec.loader = _SeedingLoader(spec.loader)
        return spec


class _SeedingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)  # raises: the hook stays for the next attempt
        with _SeedTorchOnImport._lock:
            seed, _SeedTorchOnImport.pending = _SeedTorchOnImport.pending, None
        _SeedTorchOnImport.uninstall()
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
