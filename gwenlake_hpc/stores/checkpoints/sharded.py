"""Sharded training states (FSDP2, DTensor, FSDP1) through torch.distributed.checkpoint (DCP), sealed and verified.

Responsibilities:

- say whether a model's state is sharded over the ranks (:func:`is_sharded_model`: DTensors, or an FSDP1
  ``FullyShardedDataParallel`` module inside it, whose parameters are plain tensors), whether a state holds
  DTensors (:func:`holds_dtensors`) and whether a path is a DCP folder (:func:`is_dcp_folder`):
  ``save_state``/``load_state`` (:mod:`.state`) dispatch on them;
- refuse, before anything is written or read, what DCP's ``get_state_dict`` cannot key by the model's
  parameter names (:func:`check_optimizer`: an optimizer parameter that is not the model's), a ConfigError;
- write a sharded state (:func:`save_sharded`, :func:`write_dcp`): every rank writes its own shards in
  parallel with DCP's planners and ``FileSystemWriter`` (``sync_files=True``: each file fsynced), into one DCP folder
  (``.metadata`` + ``__<rank>_<n>.distcp``) at the same path of the one partial checkpoint; replicated tensors
  are written once (DCP's de-duplication of save plans). Each rank then hashes the files it wrote (XXH3-128)
  and records them in its :class:`~.partial.PendingCheckpoint`; the Run gathers the records to rank 0, which
  puts them in the manifest (``verify: on_load``) and seals only when every rank reported success;
- read one back on any number of ranks, a single process without a process group included, into a sharded
  or a plain model (:func:`load_sharded`): ``get_state_dict`` -> ``dcp.load`` (DCP reshards) ->
  ``set_state_dict``, verifying on every rank, before reading, the size and digest of each file its read
  plan touches (:class:`VerifyingReader`); a mismatch on any rank is a :class:`DamagedFileError` on every
  rank (DCP gathers the read errors of all ranks into one ``CheckpointException``, unwrapped here);
- a size that does not fit the model is a :class:`StateMismatchError` naming the tensor and both shapes.

FSDP1 goes the same way as FSDP2: ``get_state_dict``/``set_state_dict`` set FSDP1's ``SHARDED_STATE_DICT`` type for
their call (whatever type the user set: FULL, SHARDED or LOCAL is restored after it) and give each rank's shard
of every original parameter, and of its optimizer state, as ShardedTensors under the original parameters' names
(``use_orig_params`` True or False alike: the flat parameters never reach the folder), so any world size, FSDP1,
FSDP2 or a plain model, reads the folder back. FSDP1's state dict is made anew at each call (gathered and
re-chunked by FSDP1): its host copies are not reused from one asynchronous checkpoint to the next.

Layout of the DCP folder's keys: ``model`` (the model's state dict, DTensors or ShardedTensors as they are),
``optim`` (the optimizer's, keyed by parameter name, as ``get_state_dict`` gives it), ``gwenlake.doc`` (a JSON
document: the structure of the scheduler and extra values, as in a safetensors state file) and
``gwenlake.t.<name>`` (their tensors). Any DCP tool (``dcp_to_torch_save``, ``dcp.load``) reads it.

Asynchronous checkpoints (the default): ``save_state`` inside the block only starts the staging of the state
(each rank's shards copied, in DCP's staging thread, into host memory reused from one checkpoint to the next:
:meth:`PendingCheckpoint.stage`; the next optimizer ``step()`` waits for the copy); each rank's background
writer then runs :func:`write_dcp` on a gloo process group of its own, so the loop goes on during the copy,
the write, the hashing and the seal. ``save_state``/``load_state`` of a sharded state are collectives:
every rank calls them, in the same order (a checkpoint in which the ranks staged different numbers of sharded
states is refused on every rank). Imports no runtime, no job.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import torch

from ...base.errors import CheckpointError, ConfigError, DamagedFileError, StateMismatchError
from .buffers import wait_for_staging
from .digest import file_digest
from .manifest import manifest_entry
from .partial import PendingCheckpoint

#: DCP's metadata file in a DCP folder.
METADATA = ".metadata"
_DOC = "gwenlake.doc"
_TENSOR = "gwenlake.t."


def holds_dtensors(value: Any) -> bool:
    """True when ``value`` (a state dict, nested mappings and sequences) holds a DTensor anywhere."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return True
    if isinstance(value, Mapping):
        return any(holds_dtensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_dtensors(v) for v in value)
    return False


def holds_fsdp1(model: Any) -> bool:
    """True when ``model`` (an ``nn.Module``) is or holds an FSDP1 ``FullyShardedDataParallel`` module."""
    modules = getattr(model, "modules", None)
    if modules is None or not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in modules())


def is_sharded_model(model: Any) -> bool:
    """True when ``model``'s state is sharded over the ranks: its parameters or buffers are DTensors (FSDP2,
    tensor parallelism) or it holds an FSDP1 module (whose parameters are plain tensors: flat ones, or views of
    them with ``use_orig_params=True``). Reads no state dict: no collective."""
    if not isinstance(model, torch.nn.Module):
        return False
    return holds_dtensors([*model.parameters(), *model.buffers()]) or holds_fsdp1(model)


def check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    """Refuse an optimizer of a sharded model that steps a parameter the model does not hold:
    ``get_state_dict`` keys the optimizer's state by the model's parameter names, so that parameter's state
    could be neither saved nor restored (DCP raises a bare KeyError). Local: no collective, the same answer on
    every rank.

    Raises:
        ConfigError (exit 2): naming the parameter group, the position and the shape of the parameter.
    """
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in own:
                raise ConfigError(
                    f"{what}: the optimizer's parameter {i} of group {g} (shape {list(p.shape)}) is not a "
                    "parameter of the model: the state of a sharded model's optimizer (FSDP1, FSDP2) is saved by "
                    "torch.distributed.checkpoint under the model's parameter names, so this one could not be "
                    "restored; give the optimizer the model's parameters only (make the tensor a parameter of the "
                    "model, or save it with extra=)")


def is_dcp_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder written by DCP (it holds ``.metadata``)."""
    p = Path(path)
    return p.is_dir() and (p / METADATA).is_file()


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        """DCP's FileSystemWriter (one file a rank, fsynced) that remembers the files this rank wrote."""

        def __init__(self, path: Path):
            super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
            self.written: list[str] = []

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            self.written.extend(wr.storage_data.relative_path for wr in fut.wait())
            return fut

    return RecordingWriter


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  doc: Mapping[str, Any] | None = None,
                  tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The state dict :func:`save_sharded` gives DCP: ``model`` and ``optim`` from ``get_state_dict`` (DTensors
    as they are, no copy, no collective; FSDP1: each rank's ShardedTensors, a collective), the other parts'
    document and tensors (see the module's docstring).

    Raises:
        ConfigError: the optimizer steps a parameter the model does not hold (:func:`check_optimizer`).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    check_optimizer(model, optimizer, "save_state")

    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    state[_DOC] = json.dumps(dict(doc or {}))
    state.update({_TENSOR + name: t for name, t in (tensors or {}).items()})
    return state


def save_sharded(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 doc: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                 pending: PendingCheckpoint | None) -> Path:
    """Write a sharded state as a DCP folder at ``path`` (a collective: every rank calls it).

    In an asynchronous checkpoint (``pending.asynchronous``) nothing is written here: a copy of the state into
    the run's reused host memory starts (:meth:`PendingCheckpoint.stage`: DCP's ``DefaultStager`` in its
    staging thread, pinned memory and non-blocking copies on CUDA; the next optimizer step waits for it; FSDP1:
    copied at once by DCP's ``BlockingAsyncStager``, into memory allocated for this checkpoint) and
    the write is left to the checkpoint's background writer (:meth:`PendingCheckpoint.write_deferred`), which
    every rank runs on a process group of its own.

    Args:
        path: the folder (conventionally ``state.safetensors`` inside the checkpoint; a rank other than 0 of a
            checkpoint writes into rank 0's partial directory, see :meth:`PendingCheckpoint.sharded_target`).
        model: the (FSDP2 / DTensor / FSDP1) model; its state through ``get_state_dict``.
        optimizer: its optimizer, or None.
        doc: the JSON document of the other parts (scheduler, extra), written as ``gwenlake.doc``.
        tensors: their tensors by name (``scheduler.x``, ``extra.blob``), written as ``gwenlake.t.<name>``.
        pending: the open checkpoint ``path`` belongs to, which records this rank's files (size, digest); None
            outside a checkpoint.

    Returns:
        The folder written, or to be written (on ranks other than 0, in the shared checkpoint directory).

    Raises:
        CheckpointError: no model given.
        ConfigError: the optimizer steps a parameter the model does not hold (:func:`check_optimizer`).
        torch.distributed.checkpoint.api.CheckpointException: a rank failed writing (raised on every rank).
    """
    if model is None:
        raise CheckpointError(f"{path}: a sharded state needs the model (save_state(..., model=m, optimizer=opt))")
    target = pending.sharded_target(path) if pending is not None else Path(path)
    state = sharded_state(model, optimizer, doc, tensors)
    if pending is not None:
        rel = Path(path).absolute().relative_to(pending.dir.absolute()).as_posix()
        pending.note_sharded(f"{rel} ({', '.join(k for k in ('model', 'optim') if k in state)})")
    if pending is not None and pending.asynchronous and holds_fsdp1(model):
        # FSDP1's ShardedTensors, made anew at each call, which DCP's DefaultStager cannot copy: DCP's
        # BlockingAsyncStager copies them to host memory here, in the loop (allocated at every checkpoint)
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        staged = Future()
        staged.set_result(BlockingAsyncStager().stage(state))
        pending.defer(lambda group: write_dcp(target, staged.result(), pending, group), staged)
        return target
    if pending is not None and pending.asynchronous:
        staged = pending.stage(state)  # a Future: the copy runs while the loop goes on
        pending.defer(lambda group: write_dcp(target, staged.result(), pending, group), staged)
        return target
    write_dcp(target, state, pending, None)
    return target


def write_dcp(target: Path, state: Mapping[str, Any], pending: PendingCheckpoint | None, group: Any) -> None:
    """Write ``state`` (:func:`sharded_state`, staged or live) as the DCP folder ``target`` with DCP's planners
    and ``FileSystemWriter`` (each file fsynced), then hash the files this rank wrote and record them in
    ``pending`` (None: outside a checkpoint, nothing recorded).

    ``group``: the process group of DCP's collectives (the background writer's own); None: the default group,
    or none at all in a single process. A collective over that group: every rank calls it.

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: a rank failed writing (raised on every rank).
        OSError: hashing a written file failed.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    writer = _writer_class()(target)
    if dist.is_initialized() and (group is not None or dist.get_world_size() > 1):
        dcp.save(dict(state), storage_writer=writer, process_group=group)
    else:
        with _single_process_quiet():
            dcp.save(dict(state), storage_writer=writer, no_dist=True)
    if pending is not None:
        # one file a rank holds many write results: each file hashed once (dict keeps their order)
        coordinator = not dist.is_initialized() or dist.get_rank(group) == 0
        names = list(dict.fromkeys(writer.written)) + ([METADATA] if coordinator else [])
        for rel in names:
            p = target / rel
            pending.record_shard(p, p.stat().st_size, file_digest(p))


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class VerifyingReader(FileSystemReader):
        """DCP's FileSystemReader that checks, before reading, each file its read plan touches against the
        manifest of the checkpoint holding the folder (size, digest); files of a folder outside a checkpoint,
        or not listed, are read as they are."""

        def __init__(self, path: Path):
            super().__init__(path)
            self._checked: set[str] = set()
            self._checkpoint: Path | None = None  # the sealed checkpoint whose manifest lists this folder

        def check(self, rel: str) -> None:
            """Raises DamagedFileError when file ``rel`` of the folder is missing or does not match, or is not
            in the manifest of the checkpoint that lists the folder's ``.metadata`` (a shard DCP's metadata
            names but the seal never saw)."""
            if rel in self._checked:
                return
            p = Path(self.path) / rel
            entry = manifest_entry(p)
            if entry is None and self._checkpoint is not None:
                raise DamagedFileError(f"{p} is not in checkpoint {self._checkpoint.name}'s manifest, whose DCP "
                                       "metadata names it: a shard missing from the checkpoint", p,
                                       self._checkpoint)
            if entry is not None:
                if rel == METADATA:
                    self._checkpoint = entry[0]
                ck, alg, digest, size = entry
                if not p.is_file():
                    raise DamagedFileError(f"{p} is missing from checkpoint {ck.name}", p, ck)
                if p.stat().st_size != size:
                    raise DamagedFileError(f"{p} has {p.stat().st_size} bytes, its manifest says {size}", p, ck)
                if file_digest(p, alg) != digest:
                    raise DamagedFileError(f"{p} does not match its {alg} digest in {ck.name}'s manifest", p, ck)
            self._checked.add(rel)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            self.check(METADATA)
            return super().read_metadata(*args, **kwargs)

        def read_data(self, plan: Any, planner: Any) -> Any:
            for rel in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                self.check(rel)
            return super().read_data(plan, planner)

    return VerifyingReader


def _unwrap(exc: BaseException) -> BaseException:
    """The error to raise for a DCP ``CheckpointException``: a DamagedFileError of any rank first (every rank
    then raises it), then a size mismatch as StateMismatchError, else a CheckpointError listing the ranks."""
    failures = getattr(exc, "failures", {}) or {}
    errors = [(rank, pair[0] if isinstance(pair, tuple) else pair) for rank, pair in sorted(failures.items())]
    for rank, e in errors:
        if isinstance(e, DamagedFileError):
            return DamagedFileError(f"rank {rank}: {e}", e.path, e.checkpoint)
    for rank, e in errors:
        if isinstance(e, ValueError) and "Size mismatch" in str(e):
            return _mismatch(str(e))
    text = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in errors) or str(exc)
    return CheckpointError(f"reading the sharded state failed: {text}")


def _mismatch(message: str) -> StateMismatchError:
    # DCP's message: "Size mismatch between saved torch.Size([4]) and current: torch.Size([5]) for model.0.bias"
    saved, _, rest = message.partition(" and current: ")
    current, _, name = rest.partition(" for ")
    saved = saved.rpartition("saved ")[2]
    return StateMismatchError(f"tensor {name!r} has shape {_shape(current)} in the model and {_shape(saved)} in "
                              "the saved state: build the model as it was when it was saved")


def _shape(text: str) -> str:
    return text.replace("torch.Size(", "").rstrip(")") if text.startswith("torch.Size(") else text


def load_sharded(path: Path, *, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 strict: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore a DCP folder written by :func:`save_sharded` into ``model`` and ``optimizer`` (a collective
    where a process group exists: every rank calls it), on any world size, sharded or not.

    Returns:
        ``(doc, tensors)``: the JSON document and the tensors of the other parts, for ``load_state`` to decode.

    Raises:
        DamagedFileError: a file this rank or another reads does not match the checkpoint's manifest.
        StateMismatchError (exit 2): a tensor's shape differs between the folder and the model.
        ConfigError: the optimizer steps a parameter the model does not hold (:func:`check_optimizer`).
        CheckpointError: a part asked for was not saved, or the read failed otherwise.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)

    if model is not None:
        check_optimizer(model, optimizer, "load_state")
    wait_for_staging()  # the model is about to change: a checkpoint's copy of it must be complete
    reader = _reader_class()(path)
    metadata = reader.read_metadata()  # verified first: every rank checks the same file
    saved = metadata.state_dict_metadata
    parts = {key.split(".", 1)[0] for key in saved if not key.startswith("gwenlake.")}
    for key, obj in (("model", model), ("optim", optimizer)):
        if obj is not None and key not in parts:
            raise CheckpointError(f"{path} holds no {'optimizer' if key == 'optim' else key} state (it has: "
                                  f"{', '.join(sorted(parts)) or 'nothing'})")
    state: dict[str, Any] = {_DOC: ""}
    for key, md in saved.items():
        if key.startswith(_TENSOR) and isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    if model is not None and optimizer is not None:
        state["model"], state["optim"] = get_state_dict(model, optimizer)
    elif model is not None:
        state["model"] = get_model_state_dict(model)
    elif optimizer is not None:
        raise CheckpointError(f"{path}: a sharded optimizer state is restored with its model (model=, optimizer=)")
    try:
        with _single_process_quiet():
            # flatten_sharded_tensors (for FSDP1 under 2-D parallelism, whose ShardedTensors nest) drops a
            # ShardedTensor with no shard on this rank (FSDP1 chunks a tensor of fewer rows than ranks so): its
            # key then looks missing and the load fails. Nothing here nests them: 2-D FSDP1 gives DTensors.
            planner = DefaultLoadPlanner(allow_partial_load=not strict, flatten_sharded_tensors=False)
            dcp.load(state, storage_reader=reader, planner=planner,
                     no_dist=not torch.distributed.is_initialized())
    except CheckpointException as exc:
        raise _unwrap(exc) from None
    except ValueError as exc:  # a single process: DCP raises the planner's error as it is
        if "Size mismatch" in str(exc):
            raise _mismatch(str(exc)) from None
        raise
    options = StateDictOptions(strict=strict)
    if model is not None and optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    elif model is not None:
        set_model_state_dict(model, state["model"], options=options)
    doc = json.loads(state[_DOC]) if state[_DOC] else {}
    return doc, {k[len(_TENSOR):]: v for k, v in state.items() if k.startswith(_TENSOR)}
