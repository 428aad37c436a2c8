"""The loop example of the user guide (docs/guide/writing-a-training.md), run in process (the README's main-job
command in a clean virtualenv is in tests/integration/test_readme_e2e.py)."""

from __future__ import annotations

import re

from helpers.project import REPO


def readme_python(heading: str, page: str = "docs/guide/writing-a-training.md") -> str:
    """The first python code block after ``heading`` in ``page`` (a path from the repository root)."""
    text = (REPO / page).read_text()
    after = text[text.index(heading):]
    return re.search(r"```python\n(.+?)\n```", after, re.S).group(1)


def test_readme_loop_example_schedules_the_whole_run(tmp_path, monkeypatch):
    """The loop's example as written: its OneCycleLR raises when stepped past total_steps and must end on its
    last step, in a run set by epochs (steps_for) and in one set by steps (total_steps)."""
    import numpy as np
    import torch

    from gwenlake_hpc.data import Catalog

    made = []

    class Recorded(torch.optim.lr_scheduler.OneCycleLR):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch.optim.lr_scheduler, "OneCycleLR", Recorded)
    namespace = {"__name__": "readme_loop"}
    exec(compile(readme_python("LR schedule over the whole run"), "docs/guide/writing-a-training.md", "exec"),
         namespace)
    rng = np.random.default_rng(0)
    Catalog(tmp_path / "data").write("crm.churn-train", {
        "features": rng.normal(size=(300, 3)).astype(np.float32),
        "churn": (rng.random(300) < 0.3).astype(np.float32)})
    for length, total in ({"epochs": 2}, 6), ({"steps": 5}, 5):  # 3 batches of 128 (the last 44) an epoch
        run_dir = tmp_path / f"run-{total}"
        result = namespace["fit"].local(data_root=tmp_path / "data", run_dir=run_dir, **length)
        assert np.isfinite(result["train_loss"])
        assert (made[-1].total_steps, made[-1].last_epoch) == (total, total)
        # Run again on the same run directory: as a start killed after its last checkpoint, before its commit,
        # it resumes at the last step with nothing to train and returns the same values.
        again = namespace["fit"].local(data_root=tmp_path / "data", run_dir=run_dir, **length)
        assert again == result


