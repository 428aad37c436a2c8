"""Checkpoints: atomic, streamed, asynchronous, verified while loading. One concern a module:

- :mod:`.manifest`: a sealed checkpoint on disk: its names, its manifest's format versions, ``Checkpoint``.
- :mod:`.partial`: a checkpoint being written: into a partial directory, sealed with a manifest, renamed.
- :mod:`.store`: the checkpoints of a run on disk: publish a seal; find the newest intact one; set damaged ones
  aside; retention.
- :mod:`.state`: ``save_state``/``load_state``, a training state (model, optimizer, scheduler, extras) in one
  safetensors file.
- :mod:`.statedoc`: the metadata document of a ``save_state`` file (its key, format, dropped names).
- :mod:`.sharded`: FSDP2 / DTensor states as one DCP folder written by every rank, verified while read, on any
  world size (``save_state``/``load_state`` dispatch to it).
- :mod:`.tensorfile`: the safetensors format written and read in one streamed pass with its digest; host
  snapshots for asynchronous writes.
- :mod:`.buffers`: the host buffers reused by asynchronous checkpoints, allocated ahead when their sizes are known.
- :mod:`.writer`: the background thread that seals asynchronous checkpoints, one at a time.
- :mod:`.digest`: the file digests of manifests (XXH3-128; sha256 for format 1).
- :mod:`.levels`: the node-local first level (``checkpoint.local_dir``): the copy to the shared level, the copier.
- :mod:`.resume`: the resume rule (``job.resume=auto|never``) over a store, shared by the job and the Run.
- :mod:`.consolidate`: one safetensors model file from a sharded (DTensor) model or a DCP folder, tensor
  by tensor.
"""

from .buffers import BufferPool
from .manifest import MANIFEST, RANKS_DIR, RUN_STATE, Checkpoint, rank_state_name
from .partial import PendingCheckpoint
from .store import CheckpointStore
from ...base.errors import CheckpointFormatError, DamagedFileError
from .writer import BackgroundWriter

__all__ = ["MANIFEST", "RANKS_DIR", "RUN_STATE", "BufferPool", "Checkpoint", "CheckpointFormatError",
           "CheckpointStore", "PendingCheckpoint", "rank_state_name", "DamagedFileError", "BackgroundWriter"]
