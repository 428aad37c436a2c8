"""The documentation site builds without a warning, and the README's links lead somewhere.

``mkdocs build --strict`` fails on a warning: a broken link or anchor between pages (mkdocs.yml's
``validation``), a page missing from the nav, and a docstring of the API reference that griffe cannot match with
its signature (a documented parameter the function does not have)."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers.project import REPO

# [text](target) and [text](target "title"); images too. Reference-style links are not used in the README.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    # The API reference was rendered from the docstrings, not left as `::: name` lines.
    api = (tmp_path / "site" / "reference" / "run" / "index.html").read_text()
    assert 'id="gwenlake_hpc.runtime.run.Run.steps"' in api


def anchors(markdown: str) -> set[str]:
    """The ids mkdocs gives the headings of a page (Python-Markdown's toc slugify on the heading's text)."""
    from markdown.extensions.toc import slugify

    text = FENCE.sub("", markdown)
    return {slugify(re.sub(r"[`*]", "", m.group(1)).strip(), "-")
            for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def test_every_relative_link_of_the_readme_points_at_a_file():
    readme = (REPO / "README.md").read_text()
    targets = [t for t in LINK.findall(FENCE.sub("", readme))
               if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not files here
    assert targets, "the README links into docs/"
    broken = []
    for target in targets:
        path, _, anchor = target.partition("#")
        file = (REPO / path) if path else REPO / "README.md"
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert broken == []


def test_the_readme_keeps_the_main_job_command():
    """A CI hook greps the README for the main job's command."""
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m gwenlake_hpc +job=churn" in readme
    assert "bash scripts/test.sh" in readme
