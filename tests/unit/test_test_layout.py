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


def test_the_streams_of_scripts_test_sh_cover_every_test_file_once():
    """scripts/test.sh shares the suite among streams by file name: tests/unit, the integration tests' globs
    (each file in exactly one) and tests/cluster (the markers slurm and waits do the rest). A test file named
    outside those globs (test_Big.py, test_i.py, a sub-folder) would run in no stream."""
    import fnmatch

    script = (TESTS.parent / "scripts" / "test.sh").read_text()
    globs = ["tests/integration/test_[a-h]*.py", "tests/integration/test_integrations_hf.py",
             "tests/integration/test_integrations_[!h]*.py", "tests/integration/test_[j-z]*.py"]
    assert all(g in script for g in globs) and "tests/unit" in script and "tests/cluster" in script
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = str(path.relative_to(TESTS.parent))
        tier = path.relative_to(TESTS).parts[0]
        assert tier in ("unit", "integration", "cluster") and len(path.relative_to(TESTS).parts) == 2, rel
        if tier == "integration":
            assert sum(fnmatch.fnmatchcase(rel, g) for g in globs) == 1, rel
