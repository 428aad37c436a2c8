"""The metadata document of a ``save_state`` file, written by :mod:`.state` and :mod:`.consolidate` alike.

A safetensors file holds ``name -> tensor`` and ``str -> str`` metadata. ``save_state`` puts one JSON document
under :data:`META_KEY`: its format, the writer's version, the structure of what was saved (tensors by name,
other values as JSON), the exact aliases (tied weights stored once) and, from format 2, partial views. After it
come ``safetensors.torch.save_model``'s own records of the names it dropped (dropped name -> kept name), so that
safetensors' ``load_model`` reads the file as it reads its own.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

#: The metadata key of the document.
META_KEY = "gwenlake_state"
#: The newest format of the document; a reader refuses a larger one. A file is written with the lowest format
#: that reads it: 2 only when it records partial views (``views``).
FORMAT = 2


def state_metadata(doc: Mapping[str, Any], dropped: Mapping[str, str]) -> dict[str, str]:
    """The file's metadata: ``doc`` as JSON under :data:`META_KEY`, then each dropped name -> kept name, sorted
    (never replacing the document)."""
    return {META_KEY: json.dumps(doc), **{k: v for k, v in sorted(dropped.items()) if k != META_KEY}}
