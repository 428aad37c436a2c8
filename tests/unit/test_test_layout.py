"""The test tree itself: pytest imports test modules by basename (rootdir-relative, no packages), so two files
called ``test_x.py`` in two tiers make the whole collection fail with "import file mismatch" (it ended a CI run
once). This keeps basenames unique across ``tests/unit``, ``tests/integration`` and ``tests/cluster``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique_across_tiers():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.rglob("test_*.py")):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
    assert len(seen) > 40  # the walk found the tiers
