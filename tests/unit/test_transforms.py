"""Short fits (gwenlake_hpc.transforms): DataFrames in, a version out, through the same job as a long training."""

from __future__ import annotations

import numpy as np
import pytest

from gwenlake_hpc.data import Catalog
from gwenlake_hpc.base.errors import TrainDefinitionError
from gwenlake_hpc.transforms import Input, Output, to_frame, train


def test_to_frame_flattens_wide_columns_and_keeps_strings(tmp_path):
    catalog = Catalog(tmp_path)
    catalog.write("g.d", {"x": np.arange(6, dtype=np.float32).reshape(3, 2), "s": np.array(["a", "b", "c"]),
                          "y": np.array([1, 0, 1], dtype=np.int64)})
    with catalog.open("g.d") as ds:
        frame = to_frame(ds)
    assert list(frame.columns) == ["x_0", "x_1", "s", "y"]
    assert frame["x_1"].tolist() == [1.0, 3.0, 5.0] and frame["s"].tolist() == ["a", "b", "c"]
    assert frame["y"].tolist() == [1, 0, 1]
    with catalog.open("g.d") as ds:
        try:
            import polars  # noqa: F401
        except ImportError:
            with pytest.raises(TrainDefinitionError, match="pip install polars"):
                to_frame(ds, polars=True)
        else:
            assert type(to_frame(ds, polars=True)).__name__ == "DataFrame"


@pytest.mark.parametrize("kwargs, fn, needle", [
    ({"steps": 10}, lambda data, output: None, "a short fit has no loop"),
    ({}, lambda data, output, run: None, "a short fit has no `run`"),
    ({"bogus": 1}, lambda data, output: None, "not a binding"),
    ({"memory": "32 GB"}, lambda data, output: None, "memory='32 GB'"),
    ({}, lambda output: None, "no parameter for data"),
])
def test_bad_short_fits_fail_at_decoration(kwargs, fn, needle):
    with pytest.raises(TrainDefinitionError, match=needle.replace("(", r"\(")):
        train(data=Input("t.rows"), output=Output("t.model"), **kwargs)(fn)


def test_loop_settings_are_refused_for_a_short_fit(project):
    bad = project.run("job.target=trainer.py:short", "job.steps=5")
    assert bad.returncode == 2 and "is a short fit (one call, no loop)" in bad.stdout + bad.stderr
