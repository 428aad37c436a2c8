"""One-line, exactly restorable training state in a safetensors file.

safetensors stores flat ``name -> tensor`` maps with ``str -> str`` metadata. It refuses what a PyTorch
training state is made of: optimizer state dicts (nested, integer keys, Python scalars and tuples), scheduler
state, non-string metadata and tensors that share storage (tied weights). ``save_state`` flattens all of that:
tensors go into the file under their path, everything else into one JSON document in the metadata, with
dict key types and tuples preserved so ``load_state`` rebuilds the exact same objects.

Layout. A file holding only a model (``save_state(path, model=m)``, what ``output.file(...)`` usually gets) names
its tensors by the state dict's own keys and drops tensors that share storage as
``safetensors.torch.save_model`` does, with the same tensors, bytes and metadata: any safetensors consumer loads
it as it is (``load_file`` + ``load_state_dict``, or ``load_model``). A file holding more (optimizer, scheduler,
extra) prefixes each part's names (``model.0.weight``, ``optimizer.state.0.exp_avg``). ``load_state`` reads both,
and model-only files written before this change (prefixed too).

The file is written in one streamed pass (:mod:`.tensorfile`): no whole-file bytes in memory, hashed on the
way. Inside ``with run.checkpoint() as ck`` it belongs to the checkpoint: an asynchronous checkpoint only
takes a snapshot here and writes it in the background. ``load_state`` verifies a checkpoint file's digest
while it reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ...base.errors import CheckpointError, StateMismatchError
from .sharded import (holds_dtensors, holds_fsdp1, is_dcp_folder, is_sharded_model, load_sharded, save_sharded,
                      sharded_state)
from .statedoc import FORMAT, META_KEY, state_metadata
from .manifest import check_format, manifest_entry, writer_version
from .partial import open_checkpoint_of
from .tensorfile import read_tensors, write_tensors


def save_state(path: str | os.PathLike, *, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
               extra: Mapping[str, Any] | None = None) -> Path:
    """Write a model, optimizer, LR scheduler and extra values into one safetensors file.

    Args:
        path: destination file (conventionally ``*.safetensors``). Written to a temporary file beside it,
            fsynced, then renamed, so a reader never sees half a file. Inside an asynchronous
            ``run.checkpoint()`` block (the default) the values are copied into a host buffer and the file is
            written after the block by a background thread; the training may change the model at once.
        model: its ``state_dict()`` is stored; tied (shared) weights are stored once and restored under
            every name. Given alone, the tensors keep the state dict's own names and shared tensors are dropped
            as ``safetensors.torch.save_model`` drops them (same file, plus gwenlake's metadata); with other
            parts, names are prefixed by the part (``model.``, ``optimizer.``, ``scheduler.``, ``extra.``).
        optimizer: its ``state_dict()`` (tensors such as ``exp_avg``, plus ``step`` and ``param_groups``).
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (LR schedulers, GradScaler).
        extra: further values: tensors, numpy arrays, and JSON-able Python values (int, float, str, bool,
            None, lists, tuples, dicts with str/int keys).

    Tensors are copied to the CPU one at a time; dtypes and shapes are kept exactly.

    Sharded states: when the model is sharded (DTensors: FSDP2, tensor parallelism; or an FSDP1
    ``FullyShardedDataParallel`` module, whatever its ``use_orig_params`` and ``state_dict_type``), inside
    ``run.checkpoint()`` ``path`` becomes a folder in torch.distributed.checkpoint's format written by every rank
    (call it on every rank, in the same order); in an asynchronous checkpoint each rank only copies its shards
    into host memory here (reused for FSDP2), and writes them in the background; see :mod:`.sharded`. A sharded
    model alone outside a checkpoint (``save_state(output.file("model.safetensors"), model=m)`` at the end) is
    written as one full safetensors file by rank 0, tensor by tensor, never the whole model in one rank's memory
    (:func:`.consolidate.write_full_model`; every rank calls it; FSDP1: its full state dict, gathered by FSDP1
    unit by unit into rank 0's host memory, written by rank 0).

    Returns:
        The path written (for a sharded state on a rank other than 0, in the checkpoint's shared directory).

    Raises:
        CheckpointError: a value is neither a tensor nor JSON-able (the message names its path).
        ConfigError (exit 2): the optimizer of a sharded model steps a parameter the model does not hold (its
            state could not be restored: :func:`.sharded.check_optimizer`).
    """
    parts: dict[str, Any] = {}
    # A sharded model's state (and its optimizer's) is read once, by get_state_dict in save_sharded, not here.
    # FSDP1's own state_dict() (FULL by default: every rank gathers the whole model) is never called here.
    sharded = is_sharded_model(model)
    if model is not None:
        parts["model"] = None if sharded else model.state_dict()
    if optimizer is not None:
        parts["optimizer"] = None if sharded else optimizer.state_dict()
    if scheduler is not None:
        parts["scheduler"] = scheduler.state_dict()
    if extra is not None:
        parts["extra"] = dict(extra)

    tensors: dict[str, torch.Tensor] = {}
    if sharded or holds_dtensors(parts.get("model")) or holds_dtensors(parts.get("optimizer")):
        if list(parts) == ["model"] and open_checkpoint_of(path) is None:
            # A sharded model's file outside a checkpoint (the version's ``output.file``): one full safetensors
            # file, gathered tensor by tensor and written by rank 0, that any safetensors reader opens.
            from .consolidate import write_full_model

            return write_full_model(path, model)
        # FSDP2 / DTensor / FSDP1: every rank writes its shards into a DCP folder at ``path`` (see .sharded).
        doc = _sharded_doc(parts, tensors)
        return save_sharded(Path(path), model=model, optimizer=optimizer, doc=doc, tensors=tensors,
                            pending=open_checkpoint_of(path))
    tensors, meta = _plain_file(parts)
    path = Path(path)
    pending = open_checkpoint_of(path)
    if pending is not None:
        return pending.put_tensors(path, tensors, meta)
    write_tensors(path, tensors, meta)
    return path


def _sharded_doc(parts: Mapping[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The JSON document of a sharded state's parts other than model and optimizer (their tensors into
    ``tensors``)."""
    others = {k: v for k, v in parts.items() if k not in ("model", "optimizer")}
    return {"format": 1, "writer": writer_version(), "structure": _encode(others, "", tensors)}


def _parts(model: Any, optimizer: Any, scheduler: Any, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Part name -> its state dict (``extra`` as a dict), for the parts given."""
    parts: dict[str, Any] = {}
    for name, part in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if part is not None:
            parts[name] = part.state_dict()
    if extra is not None:
        parts["extra"] = dict(extra)
    return parts


def sharded_staging_state(*, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                          scheduler: Any = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The state dict a ``save_state`` of these parts would stage in an asynchronous checkpoint when they are
    sharded (:func:`.sharded.sharded_state`: views of the live tensors, nothing copied), or None for a plain
    state. What ``run.prepare_checkpoint`` makes the host copies of, ahead of the first checkpoint.

    Raises:
        CheckpointError: as :func:`save_state`.
    """
    if holds_fsdp1(model):  # made anew by FSDP1 at each call: host copies made ahead would not be reused
        return None
    parts = _parts(model, optimizer, scheduler, extra)
    if model is None or not (holds_dtensors(parts.get("model")) or holds_dtensors(parts.get("optimizer"))):
        return None
    tensors: dict[str, torch.Tensor] = {}
    doc = _sharded_doc(parts, tensors)
    return sharded_state(model, optimizer, doc, tensors)


def state_file_size(*, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, extra: Mapping[str, Any] | None = None) -> int | None:
    """The size in bytes of the file ``save_state`` would write of these parts now (None for a sharded state,
    which is not snapshotted into a host buffer). Reads shapes and dtypes only: nothing is copied.

    Raises:
        CheckpointError: as :func:`save_state`.
    """
    if is_sharded_model(model):
        return None
    parts = _parts(model, optimizer, scheduler, extra)
    if holds_dtensors(parts.get("model")) or holds_dtensors(parts.get("optimizer")):
        return None
    from .tensorfile import layout

    return layout(*_plain_file(parts)).size


def _plain_file(parts: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of the safetensors file of non-sharded ``parts`` (part name -> state)."""
    tensors: dict[str, torch.Tensor] = {}
    views: dict[str, list] = {}
    dropped: dict[str, str] = {}
    if list(parts) == ["model"] or (list(parts) == ["model", "extra"] and not parts["extra"]):
        # Only a model: its own keys, so that any safetensors consumer loads the file as it is.
        structure = {"__dict__": [["model", _encode(parts["model"], "", tensors)]]}
        tensors, aliases, views = _drop_shared(tensors)
        dropped = {**aliases, **{name: v[0] for name, v in views.items()}}
    else:
        structure = _encode(parts, "", tensors)
        tensors, aliases = _unshare(tensors)
    doc = {"format": 2 if views else 1, "writer": writer_version(), "structure": structure, "aliases": aliases}
    if views:
        doc["views"] = views
    # save_model's own record of what it dropped (name -> kept name), after ours: it never replaces it either.
    return tensors, state_metadata(doc, dropped)


def load_state(path: str | os.PathLike, *, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
               strict: bool = True, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Restore what :func:`save_state` wrote into the given objects.

    Args:
        path: a file written by :func:`save_state`, or the DCP folder of a sharded state (read on any number of
            ranks, into a sharded (FSDP2, DTensor, FSDP1) or a plain model; a collective where a process group
            exists; through ``set_state_dict``: each rank's shards of the model and its optimizer).
        model: restored in place with its ``load_state_dict`` when given (a sharded model from a plain file: each
            rank keeps its shard of each tensor, through ``set_model_state_dict``).
        optimizer: restored the same way (it moves its state to its parameters' device itself).
        scheduler: restored the same way.
        strict: passed to ``model.load_state_dict``.
        map_location: device the tensors are loaded to before being copied into the objects.

    Returns:
        The ``extra`` mapping as saved (tensors, numpy arrays as tensors, Python values); empty if none.

    A file listed in the manifest of a complete checkpoint is verified while it is read: its size and digest
    must match, or nothing is restored.

    Raises:
        DamagedFileError (a CheckpointError): a checkpoint file does not match its manifest; the job sets
            that checkpoint aside and resumes from the previous intact one. For a sharded state, raised on
            every rank when any rank finds one of the files it reads damaged.
        StateMismatchError (exit 2): a tensor's shape differs from the model's (named, with both shapes), or a
            plain optimizer state given to a sharded optimizer.
        CheckpointFormatError: the file or its manifest was written by a newer gwenlake_hpc (exit 2).
        ConfigError (exit 2): the optimizer of a sharded model steps a parameter the model does not hold.
        CheckpointError: the file is missing, not a safetensors file, not written by save_state, or lacks a
            part that was asked for (e.g. ``optimizer=`` given but no optimizer saved).
    """
    path = Path(path)
    if is_dcp_folder(path):
        return _load_sharded(path, model, optimizer, scheduler, strict, map_location)
    if not path.is_file():
        raise CheckpointError(f"state file {path} does not exist")
    entry = manifest_entry(path)
    expect = entry[1:] if entry else None
    tensors, meta = read_tensors(path, expect=expect, checkpoint=entry[0] if entry else None)
    if str(map_location) != "cpu":
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    if META_KEY not in meta:
        raise CheckpointError(f"{path} was not written by gwenlake_hpc.save_state (no '{META_KEY}' metadata)")
    doc = json.loads(meta[META_KEY])
    check_format(doc.get("format"), FORMAT, f"state file {path}", doc.get("writer"))
    for name, target in doc.get("aliases", {}).items():
        tensors[name] = tensors[target]
    for name, (target, offset, shape, stride) in doc.get("views", {}).items():
        tensors[name] = _view_of(tensors[target], offset, shape, stride, f"{path}: tensor {name!r}")
    parts = _decode(doc["structure"], tensors)

    for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is None:
            continue
        if key not in parts:
            raise CheckpointError(f"{path} holds no {key} state (it has: {', '.join(sorted(parts)) or 'nothing'})")
        if key == "model" and is_sharded_model(obj):
            _load_full_into_sharded(path, obj, parts[key], strict)
        elif key == "model":
            obj.load_state_dict(parts[key], strict=strict)
        elif key == "optimizer" and (holds_dtensors(obj.state_dict()) or is_sharded_model(model)):
            raise StateMismatchError(f"{path} holds a plain optimizer state and the optimizer's is sharded "
                                     "(FSDP2 / DTensor / FSDP1): load the model from it, or resume from a sharded "
                                     "state")
        else:
            obj.load_state_dict(parts[key])
    return parts.get("extra", {})


def _load_full_into_sharded(path: Path, model: torch.nn.Module, full: Mapping[str, torch.Tensor],
                            strict: bool) -> None:
    """Load a plain (full) model state into a sharded model: each rank keeps its shard of each tensor.

    Raises:
        StateMismatchError: a tensor's shape differs (named, with both shapes).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    # global shapes under the original names (FSDP1's own state_dict() may be LOCAL: flat shards)
    for name, t in get_model_state_dict(model).items():
        if name in full and tuple(full[name].shape) != tuple(t.shape):
            raise StateMismatchError(f"tensor {name!r} has shape {list(t.shape)} in the model and "
                                     f"{list(full[name].shape)} in {path}: build the model as it was saved")
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True, strict=strict))


def _load_sharded(path: Path, model: Any, optimizer: Any, scheduler: Any, strict: bool,
                  map_location: str | torch.device) -> dict[str, Any]:
    """``load_state`` of a DCP folder (see :func:`.sharded.load_sharded`); returns the extra values."""
    doc, tensors = load_sharded(path, model=model, optimizer=optimizer, strict=strict)
    check_format(doc.get("format"), 1, f"sharded state {path}", doc.get("writer"))
    if str(map_location) != "cpu":
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    parts = _decode(doc.get("structure", {"__dict__": []}), tensors)
    if scheduler is not None:
        if "scheduler" not in parts:
            raise CheckpointError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(parts["scheduler"])
    return parts.get("extra", {})


# --- encoding -----------------------------------------------------------------------------------------------

def _encode(value: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace tensors by references and make containers JSON-able without losing key or sequence types."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and where in tensors:
        raise CheckpointError(f"two values would be stored under the name '{where}' (keys such as 'a.b' and "
                              "{'a': {'b': ...}}, or 0 and '0', are joined the same way): rename one of them")
    if isinstance(value, torch.Tensor):
        tensors[where] = value.detach()
        return {"__tensor__": where}
    if isinstance(value, np.ndarray):
        tensors[where] = torch.from_numpy(np.ascontiguousarray(value))
        return {"__ndarray__": where}
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"cannot store key {k!r} at '{where}': only str and int keys are supported")
            items.append([k, _encode(v, f"{where}.{k}" if where else str(k), tensors)])
        return {"__dict__": items}
    if isinstance(value, (list, tuple)):
        enc = [_encode(v, f"{where}.{i}", tensors) for i, v in enumerate(value)]
        return {"__tuple__": enc} if isinstance(value, tuple) else enc
    if isinstance(value, (np.generic,)):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # JSON has no NaN/inf; repr round-trips every finite float exactly.
        return {"__float__": repr(value)}
    raise CheckpointError(f"cannot store value of type {type(value).__name__} at '{where}': "
                          "use tensors, numpy arrays or JSON-able Python values")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__ndarray__" in value:
            return tensors[value["__ndarray__"]].numpy()
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__dict__" in value:
            return {k: _decode(v, tensors) for k, v in value["__dict__"]}
    return value


def _view_of(base: torch.Tensor, offset: int, shape: list[int], stride: list[int], what: str) -> torch.Tensor:
    """``base``'s elements seen as ``shape``/``stride`` from element ``offset`` (a dropped partial view).

    Raises:
        CheckpointError: the view would reach outside ``base`` (a damaged or forged header).
    """
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset - 1
    if offset < 0 or min(stride, default=0) < 0 or last >= base.numel() or not base.is_contiguous():
        raise CheckpointError(f"{what} is recorded as a view outside the tensor it shares")
    return torch.as_strided(base, shape, stride, base.storage_offset() + offset)


def _drop_shared(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str],
                                                               dict[str, list]]:
    """Drop the tensors ``safetensors.torch.save_model`` drops, recording how to restore each.

    Tensors are grouped as save_model groups them: same device and storage, overlapping bytes. In a group, the
    first name in sorted order among those covering the whole storage is kept and the others are dropped:
    exact aliases (tied weights) as ``aliases`` (name -> kept name), other views of the same dtype of a
    contiguous kept tensor as ``views`` (name -> [kept name, element offset, shape, strides]). A group that
    no tensor covers whole (save_model refuses it), and a view of another dtype, keep their own bytes.

    Returns:
        ``(tensors to write, aliases, views)``.
    """
    groups: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        store = t.untyped_storage()
        if t.device.type != "meta" and store.data_ptr() != 0 and store.nbytes() != 0:
            groups.setdefault((t.device.type, t.device.index, store.data_ptr(), store.nbytes()), []).append(name)
    aliases: dict[str, str] = {}
    views: dict[str, list] = {}
    for names in groups.values():
        for shared in _overlapping(names, tensors):
            whole = sorted(n for n in shared if _covers_storage(tensors[n]))
            if len(shared) < 2 or not whole:
                continue
            keep = tensors[whole[0]]
            for name in sorted(shared - {whole[0]}):
                t = tensors[name]
                if (t.data_ptr(), t.shape, t.stride(), t.dtype) == (keep.data_ptr(), keep.shape, keep.stride(),
                                                                    keep.dtype):
                    aliases[name] = whole[0]
                elif t.dtype == keep.dtype and keep.is_contiguous():
                    views[name] = [whole[0], t.storage_offset(), list(t.shape), list(t.stride())]
    out = {n: t for n, t in tensors.items() if n not in aliases and n not in views}
    return out, aliases, views


def _covers_storage(t: torch.Tensor) -> bool:
    store = t.untyped_storage()
    return t.data_ptr() == store.data_ptr() and t.numel() * t.element_size() == store.nbytes()


def _overlapping(names: list[str], tensors: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Split tensors of one storage into sets whose byte ranges overlap, as safetensors does (ranges sorted by
    start; one starting before the previous one's end joins its set)."""
    def end(t: torch.Tensor) -> int:
        if not t.numel():
            return t.data_ptr()
        return t.data_ptr() + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))

    areas = sorted((tensors[n].data_ptr(), end(tensors[n]), n) for n in names)
    sets = [{areas[0][2]}]
    last_stop = areas[0][1]
    for start, stop, name in areas[1:]:
        if start >= last_stop:
            sets.append({name})
        else:
            sets[-1].add(name)
        last_stop = stop
    return sets


def _unshare(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store tensors that share storage once where they are exact aliases.

    Exact aliases (same storage, offset, shape, stride and dtype: tied weights) are stored once and recorded
    as aliases. Every other tensor is written from its own bytes (views of one storage each get theirs), on
    its device: the writer copies it to the host when it writes or snapshots it, never all at once.
    """
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen_views: dict[tuple, str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            out[name] = t
            continue
        view_key = (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(),
                    tuple(t.shape), tuple(t.stride()), t.dtype)
        if view_key in seen_views:
            aliases[name] = seen_views[view_key]
            continue
        seen_views[view_key] = name
        out[name] = t
    return out, aliases
