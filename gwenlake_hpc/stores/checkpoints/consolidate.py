"""One safetensors model file from a sharded model, or from a DCP checkpoint folder, tensor by tensor.

A model sharded by FSDP2 (``fully_shard``) or tensor parallelism holds DTensors: each rank has a piece of each
parameter. The version a training commits, and what ``load_model`` / ``predict`` / any safetensors reader
opens, is one file with the full, unsharded tensors. Both functions here write that file with the layout and
metadata :func:`~gwenlake_hpc.stores.checkpoints.state.save_state` gives a plain model's file
(``save_state(path, model=m)``): the tensors under the state dict's own keys, exact aliases (tied weights)
stored once as ``safetensors.torch.save_model`` stores them, and the ``gwenlake_state`` metadata document, so
``safetensors.torch.load_file`` / ``load_model`` and ``load_state(path, model=plain_model)`` read it.

Neither ever holds the whole model: the file's header is laid out first from the global shapes and dtypes,
then the tensors are made full one at a time and streamed into the file (:func:`.tensorfile.write_layout`,
the same durable write as every checkpoint file: temporary name, fsync, rename, directory fsync).

- :func:`write_full_model`: inside the distributed job, every rank taking part; each DTensor is gathered
  (``full_tensor()``, a collective) in the file's order, and only the writing rank keeps and writes it. An FSDP1
  model (plain tensors, sharded inside FSDP1's flat parameters) is gathered by FSDP1 itself:
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` all-gathers one FSDP1 unit at a time and
  keeps the full tensors in rank 0's host memory only (the whole model there, none on the devices; a CPU
  training: every rank holds the full state dict).
- :func:`consolidate_dcp`: on one process, without a process group, from a folder ``torch.distributed.
  checkpoint`` (DCP) wrote (``.metadata`` + ``__<rank>_0.distcp``): each tensor is read by ``dcp.load`` into an
  empty full tensor, DCP assembling it from the ranks' shards.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ...base.errors import CheckpointError, ConfigError
from .digest import DEFAULT_ALGORITHM
from .statedoc import META_KEY, state_metadata
from .manifest import writer_version
from .sharded import holds_fsdp1
from .tensorfile import Layout, layout, write_layout

#: The metadata key of save_state's document (see :mod:`.statedoc`).
STATE_METADATA_KEY = META_KEY


def write_full_model(path: str | os.PathLike, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
                     *, rank_writes: int = 0, algorithm: str = DEFAULT_ALGORITHM) -> Path:
    """Write the full, unsharded state dict of a (sharded) model as one safetensors file, from one rank.

    Called by every rank of the job, with the same model (SPMD): the file holds what
    ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`` returns, element for
    element, under the keys of ``model.state_dict()``.

    Args:
        path: the file to write (conventionally ``*.safetensors``), on the writing rank; the other ranks write
            nothing. Replaced atomically (a reader sees the old file or the new one).
        model_or_state_dict: a module (its ``state_dict()`` is taken, with the names a wrapper gives: DDP's
            ``module.``, as ``save_state`` keeps them; pass ``get_model_state_dict(model)`` to drop them), or a
            state dict of tensors. DTensors (FSDP2, tensor parallel; any device) are gathered; plain tensors
            (replicated, or a non-distributed model) are written as they are, by the writing rank alone.
            A module holding FSDP1 modules: its full state dict under the original parameter names, gathered
            by FSDP1 one unit at a time into rank 0's host memory (the whole model there) when rank 0 writes
            and the parameters are on an accelerator; otherwise every rank holds the full state dict.
        rank_writes: the global rank that writes the file.
        algorithm: digest algorithm (see :mod:`.digest`); the digest is computed while writing.

    Memory: the header is built from the global shapes and dtypes without communication; then, tensor by
    tensor in the file's order, every rank calls ``full_tensor()`` (the full tensor exists on every rank, on the
    DTensor's device, until the next one) and the writing rank streams it to the file (a CUDA tensor through
    one host copy). The extra memory is about one full tensor (the largest) at a time, plus what the
    collective itself buffers; never the model.

    Exact aliases (two keys holding the same tensor: tied weights) are stored once under the first key in
    sorted order, the other recorded as an alias, as ``save_state`` does. Tensors that are partial views of
    another's storage are written with their own bytes.

    Returns:
        ``path`` on every rank.

    Raises:
        CheckpointError: a value is not a tensor (the message names the key); the ranks' state dicts differ in
            keys, shapes or dtypes; a dtype safetensors cannot store; ``rank_writes`` is not a rank of the job;
            on the other ranks: the writing rank failed (its error is raised there, the others get one naming
            it). OSError: on the writing rank, the write failed (nothing is put in place).
    """
    path = Path(path)
    if isinstance(model_or_state_dict, torch.nn.Module) and holds_fsdp1(model_or_state_dict):
        return _write_fsdp1_model(path, model_or_state_dict, rank_writes, algorithm)
    state = (model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module)
             else dict(model_or_state_dict))
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor: a model "
                                  "file holds tensors only")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    world = torch.distributed.get_world_size() if distributed else 1
    if not 0 <= rank_writes < world:
        raise CheckpointError(f"rank_writes={rank_writes} is not a rank of this job (world size {world})")

    aliases = _exact_aliases(state)
    kept = {k: v for k, v in state.items() if k not in aliases}
    lay = layout({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in kept.items()},
                 _state_metadata(list(state), aliases))
    if distributed:
        _check_same_everywhere(lay, world)
    order = [(name, kept[name]) for name, _t, begin, end in lay.entries if end > begin]

    if rank != rank_writes:
        _take_part(order, path, rank_writes, distributed)
    else:
        _write_gathered(path, lay, order, rank_writes, distributed, algorithm)
    return path


def _write_fsdp1_model(path: Path, model: torch.nn.Module, rank_writes: int, algorithm: str) -> Path:
    """:func:`write_full_model` of a model holding FSDP1 modules: FSDP1 gathers its full state dict (whatever
    ``state_dict_type`` the user set, restored after the call) into host memory, on rank 0 only when rank 0
    writes (on every rank otherwise); the writing rank writes it as a plain model's file."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # FSDP1's rank0_only gather into host memory (cpu_offload) frees the unsharded parameters it copies from when
    # they are in host memory already (a CPU training: torch 2.13 then fails). There, and when another rank
    # writes, every rank holds the full state dict and the writing rank writes it.
    on_host = all(p.device.type == "cpu" for p in model.parameters())
    if rank_writes != 0 or on_host:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return write_full_model(path, {k: v.cpu() for k, v in full.items()}, rank_writes=rank_writes,
                                algorithm=algorithm)
    # cpu_offload: FSDP1's rank0_only; the other ranks get an empty dict and hear how rank 0 fared
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    distributed = torch.distributed.is_initialized()
    if distributed and torch.distributed.get_rank() != 0:
        outcome = _outcome_of(0, None)
        if outcome is not None:
            raise CheckpointError(f"rank 0 could not write the model file {path}: {outcome}")
        return path
    try:
        for key, value in full.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor: a "
                                      "model file holds tensors only")
        aliases = _exact_aliases(full)
        kept = {k: v for k, v in full.items() if k not in aliases}
        lay = layout({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in kept.items()},
                     _state_metadata(list(full), aliases))
    except Exception as exc:
        if distributed:
            _outcome_of(0, f"{type(exc).__name__}: {exc}")
        raise
    order = [(name, kept[name]) for name, _t, begin, end in lay.entries if end > begin]
    _write_gathered(path, lay, order, 0, distributed, algorithm)  # plain tensors: no gather, then the outcome
    return path


def _take_part(order: list[tuple[str, torch.Tensor]], path: Path, rank_writes: int, distributed: bool) -> None:
    """A rank that does not write: join each gather in the file's order, then hear how the writer fared.

    Raises:
        CheckpointError: the writing rank failed (its error named).
    """
    for _name, t in order:
        if _is_dtensor(t):
            t.full_tensor()  # the writing rank's gather needs this rank's shard; the result is dropped here
    outcome = _outcome_of(rank_writes, None) if distributed else None
    if outcome is not None:
        raise CheckpointError(f"rank {rank_writes} could not write the model file {path}: {outcome}")


def _write_gathered(path: Path, lay: Layout, order: list[tuple[str, torch.Tensor]], rank_writes: int,
                    distributed: bool, algorithm: str) -> None:
    """The writing rank: gather each tensor in the file's order and stream it into ``path``; on a failure,
    join the gathers left (the others wait in them) and tell the other ranks, then raise."""
    done = 0  # entries whose gather every rank has taken part in

    def full_tensors() -> Iterator[torch.Tensor]:
        nonlocal done
        for _name, t in order:
            full = t.full_tensor() if _is_dtensor(t) else t
            done += 1
            yield full
            del full  # before the next gather: one full tensor at a time

    try:
        write_layout(path, lay, full_tensors(), algorithm)
    except Exception as exc:
        # The other ranks still wait in the gathers this rank has not joined: join them, then say why.
        try:
            for _name, t in order[done:]:
                if _is_dtensor(t):
                    t.full_tensor()
        finally:
            if distributed:
                _outcome_of(rank_writes, f"{type(exc).__name__}: {exc}")
        raise
    if distributed:
        _outcome_of(rank_writes, None)


def consolidate_dcp(dcp_dir: str | os.PathLike, path: str | os.PathLike, prefix: str | None = "model", *,
                    algorithm: str = DEFAULT_ALGORITHM) -> Path:
    """Turn the model part of a DCP checkpoint folder into one safetensors model file, on one process.

    Needs no process group (an existing one is not used): DCP reads each tensor's chunks from whichever rank's
    ``__<rank>_0.distcp`` holds them and assembles the full tensor, whatever the world size that wrote it.

    Args:
        dcp_dir: a folder written by ``torch.distributed.checkpoint.save`` to the file system (its ``.metadata``
            and ``.distcp`` files).
        path: the safetensors file to write (replaced atomically).
        prefix: the part of the saved state dict that is the model: ``"model"`` takes the entries
            ``model.<key>`` (what ``dcp.save({"model": model_state_dict, "optim": ...})`` writes) and names them
            ``<key>``; ``None`` or ``""`` takes every entry, under its own name (``dcp.save(model_state_dict)``).

    The file has the layout and metadata ``save_state(path, model=m)`` gives a plain model, with every key
    stored (DCP stores tied weights under each of their names; ``load_state``, ``load_file`` and
    ``load_state_dict`` read them; ``safetensors.torch.load_model`` with ``strict=True`` counts the second name
    as unexpected). Shapes and dtypes are the saved global ones.

    Memory: one full tensor at a time (read into an empty tensor, streamed to the file, released), plus DCP's
    read buffers for it.

    Returns:
        ``path``.

    Raises:
        CheckpointError: ``dcp_dir`` has no readable ``.metadata``; no tensor is under ``prefix`` (the message
            names the prefixes there are); an entry under ``prefix`` is not a tensor; a tensor cannot be read
            (a missing or damaged ``.distcp`` file: the message names the tensor). OSError: the write failed.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_dir = Path(dcp_dir)
    path = Path(path)
    reader = _DcpReader(dcp_dir)
    wanted = f"{prefix}." if prefix else ""
    entries: dict[str, tuple[str, Any]] = {}  # name in the file -> (name in the DCP folder, its metadata)
    for fqn, md in reader.metadata.state_dict_metadata.items():
        if fqn.startswith(wanted):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{dcp_dir}: entry {fqn!r} is not a tensor (a {type(md).__name__}): a model "
                                      "file holds tensors only")
            entries[fqn[len(wanted):]] = (fqn, md)
    if not entries:
        there = sorted({fqn.split(".", 1)[0] for fqn in reader.metadata.state_dict_metadata})
        raise CheckpointError(f"{dcp_dir} holds no tensor under the prefix {prefix!r} (its entries start with: "
                              f"{', '.join(there) or 'nothing'})")
    lay = layout({name: torch.empty(md.size, dtype=md.properties.dtype, device="meta")
                  for name, (_fqn, md) in entries.items()}, _state_metadata(list(entries), {}))

    def full_tensors() -> Iterator[torch.Tensor]:
        for name, _t, begin, end in lay.entries:
            if end > begin:
                fqn, md = entries[name]
                full = torch.empty(md.size, dtype=md.properties.dtype)
                reader.load(fqn, full)
                yield full
                del full

    write_layout(path, lay, full_tensors(), algorithm)
    return path


# --- helpers ------------------------------------------------------------------------------------------------

def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _state_metadata(keys: list[str], aliases: Mapping[str, str]) -> dict[str, str]:
    """The metadata ``save_state(path, model=m)`` writes for a model of these keys without partial views."""
    structure = {"__dict__": [["model", {"__dict__": [[k, {"__tensor__": k}] for k in keys]}]]}
    doc = {"format": 1, "writer": writer_version(), "structure": structure, "aliases": dict(aliases)}
    return state_metadata(doc, aliases)


def _exact_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Keys whose tensor is exactly another key's (tied weights): dropped name -> kept name (first sorted).

    Two DTensors are aliases when they are the same object, or have the same global shape, placements and
    mesh and local tensors that are exact aliases; plain tensors when they share storage, offset, shape,
    strides and dtype.
    """
    groups: dict[Any, list[str]] = {}
    for key, t in state.items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        if _is_dtensor(t):
            local = t.to_local()
            if local.numel() == 0:
                ident: Any = ("object", id(t))
            else:
                ident = ("dtensor", id(t.device_mesh), tuple(t.placements), tuple(t.shape), *_view_key(local))
        else:
            ident = ("tensor", *_view_key(t))
        groups.setdefault(ident, []).append(key)
    aliases: dict[str, str] = {}
    for keys in groups.values():
        first, *others = sorted(keys)
        aliases.update({k: first for k in others})
    return aliases


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def _check_same_everywhere(lay: Layout, world: int) -> None:
    """Refuse state dicts that differ between ranks (their gathers would not pair up: a hang or wrong bytes)."""
    mine = ("save_state", lay.header)  # named as Dist.where_all names a call: another call of ours is told apart
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    elsewhere = [(r, e) for r, e in enumerate(everyone)
                 if not (isinstance(e, tuple) and len(e) == 2 and e[0] == "save_state")]
    if elsewhere:
        r, e = elsewhere[0]
        call = e[0] if isinstance(e, tuple) and e and isinstance(e[0], str) else "another collective"
        raise ConfigError(f"rank {r} is in {call}, not in this save_state of a sharded model: every rank "
                          f"calls the same saves in the same order (not under `if run.is_main:`)")
    differ = [r for r, (_call, h) in enumerate(everyone) if h != lay.header]
    if differ:
        raise CheckpointError(f"rank {torch.distributed.get_rank()}'s model state dict differs from rank "
                              f"{differ[0]}'s in its keys, shapes or dtypes: every rank must pass the same model")


def _outcome_of(rank_writes: int, error: str | None) -> str | None:
    """The writing rank's outcome (None: written; else its error), told to every rank by a broadcast."""
    box = [error]
    torch.distributed.broadcast_object_list(box, src=rank_writes)
    return box[0]


class _DcpReader:
    """A DCP folder read one tensor at a time, its ``.metadata`` unpickled once (not at every ``dcp.load``)."""

    def __init__(self, dcp_dir: Path):
        from torch.distributed.checkpoint import FileSystemReader

        class Reader(FileSystemReader):
            cached: Any = None

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if self.cached is None:
                    self.cached = super().read_metadata(*args, **kwargs)
                return self.cached

        self.dir = dcp_dir
        if not (dcp_dir / ".metadata").is_file():
            raise CheckpointError(f"{dcp_dir} is not a torch.distributed.checkpoint folder (no .metadata file)")
        self._reader = Reader(str(dcp_dir))
        try:
            self.metadata = self._reader.read_metadata()
        except Exception as exc:  # unpickling a damaged file raises about anything
            raise CheckpointError(f"{dcp_dir}/.metadata cannot be read: {type(exc).__name__}: {exc}") from exc

    def load(self, fqn: str, into: torch.Tensor) -> None:
        """Read the full tensor ``fqn`` into ``into`` (CPU, its saved shape and dtype), in place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({fqn: into}, storage_reader=self._reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException (a missing file...)
            raise CheckpointError(f"{self.dir}: tensor {fqn!r} cannot be read: {type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}") from exc
