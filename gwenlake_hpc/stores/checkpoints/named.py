"""Named checkpoints: a model saved under a name of the user's choice, in a store shared by every run of that
model, with a ``latest`` entry.

``gwenlake_hpc.checkpoint(model, path="experiment-one", metadata={...}, additional_files=[...])`` inside a run
writes ``<runs_root>/<model name>/named/experiment-one/`` holding ``model.safetensors`` (the state_dict, as
:func:`save_state` writes it), ``checkpoint.json`` (name, run key, step, time, metadata, file sizes) and the
additional files; ``gwenlake_hpc.last_checkpoint_path()`` gives the newest one's folder. Unlike the run's own
checkpoints (``run.checkpoint()``, pruned with ``keep=``, for resuming) these are kept until deleted by hand,
and any run of the model can read them (a second experiment starting from the first one's weights).

Durability: a checkpoint is made in a temporary folder beside the store, fsynced, and renamed into place; one
of the same name is swapped with it in one step (``renameat2(RENAME_EXCHANGE)``; where that is missing the old
one is moved aside first), so a reader sees the old or the new one, never a mix. ``latest.json`` is replaced atomically after the rename. Writers of the same
model hold ``named/.lock`` (flock) while they rename, so two runs saving at once leave one consistent winner.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ...base.errors import CheckpointError, ConfigError
from ...base.fsutil import fsync_dir, mkdtemp, write_atomic, write_json_atomic

NAMED_DIR = "named"
LATEST_FILE = "latest.json"
INFO_FILE = "checkpoint.json"
MODEL_FILE = "model.safetensors"
MAX_METADATA_BYTES = 64 * 1024
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


def store_dir(model_root: Path) -> Path:
    """The named-checkpoint folder of a model: ``<runs_root>/<model name>/named``."""
    return Path(model_root) / NAMED_DIR


def check_name(name: str) -> str:
    """A checkpoint name is one folder name: letters, digits, ``_ . -``, 128 characters at most, not ``latest``.

    Raises:
        ConfigError: naming the accepted form (a name with ``/`` or ``..`` would leave the store).
    """
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", "..") or name.startswith(".") \
            or name == "latest":
        raise ConfigError(f"checkpoint path={name!r}: give a name of letters, digits, _ . - (128 characters at "
                          "most, not 'latest', no '/'); it names a folder of the model's checkpoint store")
    return name


def save_named(model_root: Path, name: str, model: Any, *, run_key: str, step: int,
               metadata: Mapping[str, Any] | None = None, additional_files: Iterable[str | os.PathLike] = ()) -> Path:
    """Write a named checkpoint from one process; returns its folder.

    The phases, for a caller that spreads them over the ranks of a job (``gwenlake_hpc.checkpoint``):
    :func:`check_named`, :func:`begin_named`, :func:`write_named_model` (a collective for a sharded model),
    :func:`seal_named`.

    Args:
        model_root: ``<runs_root>/<model name>``.
        name: see :func:`check_name`.
        model: an ``nn.Module`` (its state_dict is saved) or a state_dict mapping of tensors.
        run_key, step: recorded in ``checkpoint.json`` (which run wrote it, at which step).
        metadata: JSON-able values recorded as they are.
        additional_files: files copied into the folder under their own names (e.g. a tokenizer, a config).

    Raises:
        ConfigError: a bad name, metadata that is not JSON, an additional file that is missing or whose name
            clashes with the checkpoint's own files.
        CheckpointError: the model is neither a module nor a mapping of tensors.
    """
    name, meta, files = check_named(name, metadata, additional_files)
    tmp = begin_named(model_root)
    try:
        write_named_model(tmp, model)
        return seal_named(tmp, model_root, name, run_key=run_key, step=step, meta=meta, files=files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_named(name: str, metadata: Mapping[str, Any] | None,
                additional_files: Iterable[str | os.PathLike]) -> tuple[str, Any, list[Path]]:
    """The checks of a named checkpoint's arguments, before anything is written: ``(name, metadata as JSON
    values, additional files as Paths)``.

    Raises:
        ConfigError: see :func:`save_named`.
    """
    name = check_name(name)
    try:
        text = json.dumps(dict(metadata or {}), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint metadata: give JSON values (str, numbers, lists, dicts): {exc}") from None
    if len(text) > MAX_METADATA_BYTES:
        raise ConfigError(f"checkpoint metadata: {len(text)} bytes of JSON, {MAX_METADATA_BYTES} at most; put "
                          "large things in additional_files")
    if isinstance(additional_files, (str, os.PathLike)):  # one file, not its characters
        additional_files = [additional_files]
    files = [Path(f) for f in additional_files]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"checkpoint additional_files: {f} is not a file")
        if f.name in (MODEL_FILE, INFO_FILE):
            raise ConfigError(f"checkpoint additional_files: {f.name} is the checkpoint's own file name; rename it")
    return name, json.loads(text), files


def begin_named(model_root: Path) -> Path:
    """A new temporary folder in the model's named store (made with the store), where :func:`write_named_model`
    and :func:`seal_named` put the checkpoint's files.

    Raises:
        OSError: the store cannot be made or written.
    """
    store = store_dir(model_root)
    store.mkdir(parents=True, exist_ok=True)
    return Path(mkdtemp(prefix=".tmp-named-", dir=store))


def write_named_model(folder: Path, model: Any) -> Path:
    """Write ``model`` as ``<folder>/model.safetensors`` (:func:`save_state`). A sharded model (DTensors: FSDP2)
    is gathered tensor by tensor into one full file: a collective that every rank calls, with its own ``folder``
    (only rank 0 writes; see :func:`.consolidate.write_full_model`).

    Raises:
        CheckpointError: the model is neither a module nor a mapping of tensors; on a rank that does not write,
            the writing rank failed.
    """
    from .sharded import holds_dtensors
    from .state import save_state

    if isinstance(model, Mapping) and holds_dtensors(dict(model)):  # a sharded model's state dict: gathered
        from .consolidate import write_full_model

        return write_full_model(folder / MODEL_FILE, dict(model))
    if isinstance(model, Mapping):  # save_state only asks for state_dict(): a mapping is stored as it is
        return save_state(folder / MODEL_FILE, model=SimpleNamespace(state_dict=lambda: dict(model)))  # type: ignore[arg-type]
    if hasattr(model, "state_dict"):
        return save_state(folder / MODEL_FILE, model=model)
    raise CheckpointError(f"checkpoint: {type(model).__name__} is neither an nn.Module nor a state_dict")


def seal_named(tmp: Path, model_root: Path, name: str, *, run_key: str, step: int, meta: Any,
               files: list[Path]) -> Path:
    """Copy the additional ``files`` into ``tmp`` (which holds the model file), write ``checkpoint.json``, fsync
    and put ``tmp`` in place as ``<store>/<name>`` (see the module's docstring); returns that folder.

    Raises:
        OSError: a copy or a rename failed (``tmp`` is left to the caller to remove).
    """
    store = store_dir(model_root)
    for f in files:
        shutil.copyfile(f, tmp / f.name)
        with open(tmp / f.name, "rb") as fh:
            os.fsync(fh.fileno())
    sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    info = {"name": name, "run_key": run_key, "step": int(step), "time": time.time(), "metadata": meta,
            "files": sizes}
    write_json_atomic(tmp / INFO_FILE, info)
    fsync_dir(tmp)
    dest = store / name
    with _lock(store):
        for stale in store.glob(".old-*"):  # left by a writer killed between its two renames
            shutil.rmtree(stale, ignore_errors=True)
        old = None
        # A folder is swapped in here, so fsutil's file routines do not apply; the folder protocol gives
        # the same guarantee: every file in tmp and tmp itself are fsynced above, and the store's
        # directory is fsynced after the rename below.
        if dest.exists() and _exchange(tmp, dest):
            old = tmp  # readers saw the old folder, then the new one: never none
        else:
            if dest.exists():  # no RENAME_EXCHANGE here (an old kernel, some network filesystems)
                old = store / f".old-{name}-{os.getpid()}-{time.monotonic_ns()}"
                os.rename(dest, old)  # folders: the protocol above, not fsutil
            os.rename(tmp, dest)  # folders: the protocol above, not fsutil
        fsync_dir(store)
        write_atomic(store / LATEST_FILE, (json.dumps({"name": name, "run_key": run_key, "step": int(step),
                                                       "time": info["time"]}) + "\n").encode())
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def remove_named(model_root: Path, name: str) -> None:
    """Remove the named checkpoint ``name`` of the model (one process: rank 0), under the store's lock: renamed
    aside first (readers see it whole or not at all), then deleted; ``latest.json`` then names the newest one left
    (or is removed). Nothing happens when there is no such checkpoint."""
    store = store_dir(model_root)
    dest = store / name
    if not dest.is_dir():
        return
    with _lock(store):
        aside = store / f".old-{name}-removed"
        shutil.rmtree(aside, ignore_errors=True)
        dest.rename(aside)  # readers see it whole or not at all
        latest = store / LATEST_FILE
        try:
            named_latest = json.loads(latest.read_text()).get("name")
        except (OSError, ValueError):
            named_latest = None
        if named_latest == name:
            left = [i for i in list_named(model_root) if (Path(i["path"]) / INFO_FILE).is_file()]
            if left:
                newest = left[-1]
                write_atomic(latest, (json.dumps({k: newest[k] for k in ("name", "run_key", "step", "time")})
                                      + "\n").encode())
            else:
                latest.unlink(missing_ok=True)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where it is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0


def latest_path(model_root: Path) -> Path | None:
    """The folder of the newest named checkpoint of a model (``latest.json``), or None when there is none."""
    store = store_dir(model_root)
    try:
        entry = json.loads((store / LATEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    path = store / check_name(str(entry.get("name")))
    return path if (path / INFO_FILE).is_file() else None


def list_named(model_root: Path) -> list[dict[str, Any]]:
    """Every named checkpoint of a model, oldest first: ``checkpoint.json``'s fields plus ``path``, ``size``
    (bytes, all files) and ``latest`` (bool)."""
    store = store_dir(model_root)
    if not store.is_dir():
        return []
    latest = latest_path(model_root)
    out = []
    for d in store.iterdir():
        if d.name.startswith(".") or not (d / INFO_FILE).is_file():
            continue
        try:
            info = json.loads((d / INFO_FILE).read_text())
        except (OSError, ValueError):
            continue
        info.update(path=str(d), size=sum(int(v) for v in (info.get("files") or {}).values()), latest=d == latest)
        out.append(info)
    return sorted(out, key=lambda i: i.get("time", 0.0))


@contextlib.contextmanager
def _lock(store: Path) -> Any:
    with open(store / ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield
