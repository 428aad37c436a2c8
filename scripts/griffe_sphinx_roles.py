"""A griffe extension for the API reference (mkdocs.yml): the docstrings name objects with Sphinx roles
(``:class:`~gwenlake_hpc.runtime.run.Run```), which Markdown would show as written; this turns each into inline
code (the last component for a ``~`` target, as Sphinx shows it)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """``:class:`~a.b.C``` -> ```C```, ``:func:`a.b.f``` -> ```a.b.f```."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
