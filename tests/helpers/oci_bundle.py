"""An OCI bundle for the tests, made from this machine's own directories (no image to download).

The root file system is an almost empty directory holding a marker file (``/gwenlake-test-image``, visible only
inside the container) and the mount points; ``config.json`` binds the system directories read-only (``/usr``,
``/etc``, the Python installation, the virtual environment and the repository) and ``/tmp`` and ``$HOME``
read-write, in a private mount namespace only: the process and network namespaces stay the host's, as on HPC
clusters (signals reach the training directly, torch.distributed and MLflow talk over the host's network).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "gwenlake-test-image"


def make_bundle(path: Path, marker: str = "one") -> Path:
    """Write the bundle at ``path`` (``config.json`` and ``rootfs/``); ``marker`` is the marker file's text
    (two bundles with different markers are two different images)."""
    rootfs = path / "rootfs"
    for d in ("proc", "dev", "sys", "usr", "etc", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        if not (rootfs / link).is_symlink():
            os.symlink(target, rootfs / link)
    (rootfs / MARKER).write_text(marker + "\n")

    def bind(src: str, ro: bool = True) -> dict:
        (rootfs / src.lstrip("/")).mkdir(parents=True, exist_ok=True)
        return {"destination": src, "type": "bind", "source": src, "options": ["rbind", "ro" if ro else "rw"]}

    home = os.path.expanduser("~")
    ro = sorted({sys.base_prefix, sys.prefix, str(REPO)} - {"/usr"})
    mounts = [{"destination": "/proc", "type": "proc", "source": "proc"},
              bind("/dev", ro=False), bind("/sys"), bind("/usr"), bind("/etc"),
              *[bind(p) for p in ro], bind("/tmp", ro=False)]
    if os.path.isdir(home) and home != "/":
        mounts.insert(5, bind(home, ro=False))
    spec = {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["/bin/sh"],
                    "env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "cwd": "/", "noNewPrivileges": True},
        "root": {"path": "rootfs", "readonly": True},
        "mounts": mounts,
        "linux": {"namespaces": [{"type": "mount"}]},
    }
    (path / "config.json").write_text(json.dumps(spec, indent=2))
    return path
