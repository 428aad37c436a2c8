"""safetensors files written and read in one streamed pass, hashed on the way.

The on-disk format is safetensors' own (any safetensors reader opens these files): an 8-byte little-endian
header length, a JSON header (dtype, shape and ``data_offsets`` of each tensor, ``__metadata__``) padded with
spaces to a multiple of 8 bytes, then the tensors' bytes back to back. The library itself cannot hash while it
writes or verify while it reads, so the few lines that frame the format live here:

- :func:`write_tensors` streams each tensor's bytes straight from its memory to the file (no whole-file bytes
  object: the extra memory is one tensor made contiguous at most), hashing them as they go out;
- :class:`Snapshot` copies the tensors into a reusable host buffer laid out exactly as the file (pinned memory
  and non-blocking copies on CUDA), so a background thread can write it while training goes on;
- :func:`read_tensors` maps the file as safetensors' loader does and hashes the mapping before it hands out
  the tensors (views of it), so a checkpoint is verified while it is loaded instead of read twice.

Tensors are ordered as safetensors' serialiser orders them (by dtype, larger element size first, then by name),
so the bytes equal the library's own output; every tensor's offset is then a multiple of its element size,
which lets a snapshot copy straight into a typed view of the buffer.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ...base.errors import DamagedFileError  # noqa: F401 - raised here, defined with the other errors

from ...base.errors import CheckpointError
from ...base.fsutil import atomic_file
from .digest import CHUNK_BYTES, DEFAULT_ALGORITHM, new_hasher

#: torch dtype -> safetensors dtype name (the names of safetensors' format specification).
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[getattr(torch, _attr)] = _name
_BY_NAME = {v: k for k, v in DTYPES.items()}
#: The order in which safetensors' serialiser lays tensors out (then by name): element size never grows.
_ORDER = {n: i for i, n in enumerate(["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16",
                                       "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"])}
#: A header larger than this is not a safetensors header (safetensors' own limit is 100 MB).
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class Layout:
    """Where each tensor goes in a safetensors file.

    Attributes:
        header: the 8-byte length and the padded JSON header, as written.
        entries: ``(name, tensor, begin, end)`` in file order; offsets in bytes from the end of the header.
        size: the whole file's size in bytes.
    """

    header: bytes
    entries: tuple[tuple[str, torch.Tensor, int, int], ...]
    size: int


def layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Layout:
    """Lay out ``tensors`` (any device, any strides) and ``metadata`` (str -> str) as a safetensors file.

    Raises:
        CheckpointError: a dtype safetensors cannot store (e.g. complex128), or a non-string metadata value.
    """
    entries = []
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
    for name, t in sorted(tensors.items(), key=lambda kv: (_ORDER[DTYPES[kv[1].dtype]], kv[0])):
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        entries.append((name, t, offset, offset + nbytes))
        offset += nbytes
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return Layout(head, tuple(entries), len(head) + offset)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in row-major order, without a copy when it is a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.reshape(-1).contiguous().view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview, hasher: Any) -> None:
    for i in range(0, len(data), CHUNK_BYTES):
        chunk = data[i:i + CHUNK_BYTES]
        hasher.update(chunk)
        while chunk:
            n = os.write(fd, chunk)
            chunk = chunk[n:]


def _write_file(path: Path, chunks: Iterable[memoryview], hasher: Any) -> None:
    """Stream ``chunks`` into ``path`` through :func:`atomic_file`, hashing them on the way.

    The bytes go from the tensors' memory to the file descriptor by ``os.write`` (the file object's buffer
    is bypassed, so nothing is copied again); :func:`atomic_file` then does the one fsync, the rename and the
    directory fsync, and removes the temporary file if anything raises. An OSError without a file name
    (``os.write``'s) is raised again naming ``path``.
    """
    try:
        with atomic_file(path) as fh:
            fd = fh.fileno()
            for chunk in chunks:
                _write_all(fd, chunk, hasher)
                del chunk  # a tensor's host copy goes before the next is made: one at a time at most
    except OSError as exc:
        _raise_with_path(exc, path)


def write_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                  metadata: Mapping[str, str] | None = None, algorithm: str = DEFAULT_ALGORITHM) -> tuple[int, str]:
    """Write a safetensors file atomically, streaming each tensor from its memory, and hash it on the way.

    The file is written to a temporary name beside ``path``, fsynced once, renamed, and the directory fsynced:
    a reader sees the old file or the new one. CUDA tensors are copied to the CPU one at a time.

    Returns:
        ``(size in bytes, hex digest with algorithm)``.

    Raises:
        CheckpointError: see :func:`layout`. OSError: the write failed (the temporary file is removed).
    """
    lay = layout(tensors, metadata)
    hasher = new_hasher(algorithm)
    chunks = (_host_bytes(t) for _name, t, begin, end in lay.entries if end > begin)
    _write_file(Path(path), itertools.chain([memoryview(lay.header)], chunks), hasher)
    return lay.size, hasher.hexdigest()


def write_layout(path: str | os.PathLike, lay: Layout, tensors: Iterable[torch.Tensor],
                 algorithm: str = DEFAULT_ALGORITHM) -> tuple[int, str]:
    """Write the file ``lay`` describes, taking its tensors one at a time from ``tensors``, hashed on the way.

    For writers whose tensors never exist all at once (gathered one by one from a sharded model, read one by
    one from a checkpoint folder): ``lay`` comes from :func:`layout` over stand-ins of the right shapes and
    dtypes (``device="meta"`` tensors), and ``tensors`` yields, for each entry of ``lay.entries`` that has bytes
    (``end > begin``), in that order, the tensor whose bytes go there (any device, any strides). Each one is
    released before the next is asked for, so this holds one tensor (and its host copy) at most. The write is
    durable as :func:`write_tensors`'s: temporary file, one fsync, rename, directory fsync.

    Returns:
        ``(size in bytes, hex digest with algorithm)``.

    Raises:
        CheckpointError: a tensor's byte size differs from its entry's, or ``tensors`` ends early (the file is
            not put in place). OSError: the write failed (the temporary file is removed).
    """
    wanted = [(name, end - begin) for name, _t, begin, end in lay.entries if end > begin]

    def chunks() -> Iterable[memoryview]:
        yield memoryview(lay.header)
        source = iter(tensors)
        for name, nbytes in wanted:
            t = next(source, None)
            if t is None:
                raise CheckpointError(f"{path}: no tensor was given for {name!r}")
            if t.numel() * t.element_size() != nbytes:
                raise CheckpointError(f"{path}: tensor {name!r} has {t.numel() * t.element_size()} bytes, its "
                                      f"header says {nbytes}")
            data = _host_bytes(t)
            del t
            yield data
            del data  # before the next tensor is asked for: one at a time

    hasher = new_hasher(algorithm)
    _write_file(Path(path), chunks(), hasher)
    return lay.size, hasher.hexdigest()


def _raise_with_path(exc: BaseException, path: Path) -> None:
    """Re-raise ``exc``; an OSError without a file name (os.write's) gets ``path``, so the message names it."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    raise exc


class HostBuffer:
    """Host memory reused by the snapshots of successive checkpoints (pinned when CUDA tensors are copied).

    It grows when a larger snapshot needs it and is never shrunk, so peak memory stays at one snapshot.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self.allocations = 0  #: how many times memory was (re)allocated, for tests and benchmarks

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` bytes (its first bytes; contents undefined)."""
        return self.reserve(nbytes, pinned)[:nbytes]

    def reserve(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """Make the buffer hold at least ``nbytes`` bytes (pinned when asked); returns the whole buffer.

        Allocates only when it is missing, smaller or not pinned as asked (``allocations`` counts it)."""
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pinned and not buf.is_pinned()):
            self._buf = buf = None  # free the old one first: two buffers at once would double the peak
            self._buf = buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            self.allocations += 1
        return buf


class Snapshot:
    """A point-in-time copy of tensors, laid out as their safetensors file, written later by :meth:`write`.

    Taking it copies every tensor into ``buffer`` (CPU tensors at once; CUDA tensors by non-blocking copies
    on the current stream into pinned memory, with one event recorded per device). Later training steps
    may change the tensors immediately: on CUDA they run after the copies on the same stream, and the
    writer waits for the events before it reads the buffer.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
                 buffer: HostBuffer):
        self.layout = lay = layout(tensors, metadata)
        devices = {t.device for _n, t, _b, _e in lay.entries if t.device.type == "cuda"}
        self._buf = buf = buffer.take(lay.size, pinned=bool(devices))
        head = len(lay.header)
        buf[:head].copy_(torch.frombuffer(bytearray(lay.header), dtype=torch.uint8))
        for _name, t, begin, end in lay.entries:
            if end > begin:
                dst = buf[head + begin:head + end].view(t.dtype).view(t.shape)
                dst.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        self._events = []
        for dev in devices:
            with torch.cuda.device(dev):
                ev = torch.cuda.Event()
                ev.record()
                self._events.append(ev)
        # The layout keeps references to the live tensors; only their shapes were needed.
        self.layout = Layout(lay.header, (), lay.size)

    def write(self, path: str | os.PathLike, algorithm: str = DEFAULT_ALGORITHM) -> tuple[int, str]:
        """Write the snapshot to ``path`` (atomically, fsynced); returns ``(size, hex digest)``."""
        for ev in self._events:
            ev.synchronize()
        hasher = new_hasher(algorithm)
        _write_file(Path(path), [memoryview(self._buf.numpy())], hasher)
        return self.layout.size, hasher.hexdigest()


def read_tensors(path: str | os.PathLike, *, expect: tuple[str, str, int] | None = None,
                 checkpoint: Path | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map a safetensors file into CPU tensors, hashing it on the way when its digest is expected.

    The file is mapped privately (copy-on-write), as safetensors' own loader maps it: the tensors are views
    of the mapping, so loading them into a model reads each page once. With ``expect`` the whole mapping is
    hashed first, which brings every page in; the tensors are handed out only if the digest matches.

    Args:
        path: the file.
        expect: ``(algorithm, hex digest, size)`` from a checkpoint manifest; the file must match it.
        checkpoint: the checkpoint directory, named in a :class:`DamagedFileError`.

    Returns:
        ``(name -> tensor, metadata)``; the tensors are CPU tensors, writable (a write copies the page).

    Raises:
        DamagedFileError: with ``expect``: the size or the digest differs.
        CheckpointError: not a safetensors file (bad header, unknown dtype, truncated).
    """
    path = Path(path)

    def damaged(why: str) -> CheckpointError:
        if expect:
            return DamagedFileError(f"{path} {why}", path, checkpoint)
        return CheckpointError(f"{path} is not a readable safetensors file: {why}")

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if expect and size != expect[2]:
            raise damaged(f"has {size} bytes, its manifest says {expect[2]}")
        if size < 8:
            raise damaged("is truncated (no header)")
        mm = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mm)
    if expect:
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        hasher = new_hasher(expect[0])
        for i in range(0, size, CHUNK_BYTES):
            hasher.update(view[i:i + CHUNK_BYTES])
        if hasher.hexdigest() != expect[1]:
            raise damaged(f"does not match its {expect[0]} digest")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > min(_MAX_HEADER, size - 8):
        raise damaged(f"has an impossible header length {hlen}")
    try:
        header = json.loads(bytes(view[8:8 + hlen]))
    except ValueError:
        raise damaged("has a header that is not JSON") from None
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + hlen
    data = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive as long as a tensor uses it
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype = _BY_NAME.get(info.get("dtype"))
        if dtype is None:
            raise damaged(f"holds tensor {name!r} of dtype {info.get('dtype')}, unknown to this reader")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= size - start or end - begin != math.prod(shape) * itemsize:
            raise damaged(f"is truncated or has wrong offsets for tensor {name!r}")
        raw = data[start + begin:start + end]
        if (start + begin) % itemsize:  # a foreign writer's unaligned layout: copy instead of a view
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    del view
    return tensors, metadata
